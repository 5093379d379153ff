"""The writer process of async saves: serialises, hashes and writes a rank's checkpoint files outside the
training process, so that none of that Python holds the training loop's GIL.

Async saves (``checkpoint.async_save``, ``checkpoint.async_writer: process``) hand the live tensors to the
save's thread (``trainer.checkpoint.Checkpointer.save``). That thread copies them into an *arena*: host
memory shared with this rank's writer process (a ``memfd``, passed over a socket), one tensor per slot,
kept from save to save while the tensors keep their shapes. It then sends the writer the files' structure
with slots in place of the tensors (``flatten``), and waits for the reply, holding no GIL while it
waits. The writer rebuilds the objects over its own mapping of the arena and runs the same code a sync
save runs (``Checkpointer._write_files``, the ``.done-rankN`` marker, rank 0's commit), then replies.

Why a process: the thread wrote the files itself before, and pickling, hashing and the commit's
Python all queue for the GIL that the loop's thread needs after every torch op. On ``tiny`` (CPU) the
step after an async save took 9.5 ms against 5.6 with the thread writing, and 6.1 ms with a process
writing the same files, even with a core left free (docs/benchmarks/checkpoint-cost.md). DCP's
process-based async save is the same idea.

The writer is started when training starts with async saves on (``Checkpointer.start_writer``: it imports
torch, about a second, while the trainer loads its checkpoint), else by the first async save. It lives as long
as its ``Checkpointer`` and exits when the socket closes. A training process killed outright takes its
writer with it at once (the parent-death signal, Linux), as it took the thread: no save of a dead run
commits later, beside the run that resumes it. Every message is a length-prefixed pickle between this
process and its own child over an unnamed socket pair: nothing else can speak on it.

The writer's own side is ``trainer/checkpoint_writer_main.py``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

from trainer.checkpoint_thread import map_leaves

_ALIGN = 64  # each slot starts on a cache line
_HEADER = struct.Struct("!Q")


class Slot(NamedTuple):
    """A tensor's place in the arena, in the structure sent to the writer."""

    index: int


def flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a :class:`Slot`; the tensors are appended to ``tensors`` in order."""
    def slot(t: torch.Tensor) -> Slot:
        tensors.append(t)
        return Slot(len(tensors) - 1)

    return map_leaves(obj, torch.Tensor, slot)


def fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`flatten`: every :class:`Slot` replaced by its tensor."""
    return map_leaves(obj, Slot, lambda s: tensors[s.index])


def _layout(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    offsets, size = [], 0
    for shape, dtype in specs:
        offsets.append(size)
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        size += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, size


def _views(buf: mmap.mmap | None, specs: list[tuple[tuple[int, ...], torch.dtype]], offsets: list[int]) -> list[torch.Tensor]:
    out = []
    for (shape, dtype), off in zip(specs, offsets):
        n = 1
        for d in shape:
            n *= d
        if n == 0 or buf is None:
            out.append(torch.empty(shape, dtype=dtype))
        else:  # a tensor over exactly its slot: torch.save writes that slot, not the arena
            out.append(torch.frombuffer(buf, dtype=dtype, count=n, offset=off).view(shape))
    return out


class Arena:
    """Host memory shared with the writer process: one tensor per slot, for one structure of shapes."""

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype]]):
        self.specs = specs
        self.offsets, self.size = _layout(specs)
        self.fd = os.memfd_create("sentinel-checkpoint", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.buf = mmap.mmap(self.fd, self.size) if self.size else None
        except BaseException:
            os.close(self.fd)
            raise
        self.tensors = _views(self.buf, specs, self.offsets)

    def close(self) -> None:
        self.tensors = []
        if self.buf is not None:
            with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with the process
                self.buf.close()
        os.close(self.fd)


def _specs(tensors: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def _send(sock: socket.socket, msg: Any, fds: list[int] | None = None) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    head = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [head], fds)
    else:
        sock.sendall(head)
    sock.sendall(data)


def _recv(sock: socket.socket) -> tuple[Any, list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
    if not head:
        raise EOFError("the other end closed the socket")
    while len(head) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(head))
        if not more:
            raise EOFError("the other end closed the socket")
        head += more
    (n,) = _HEADER.unpack(head)
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the socket")
        data += chunk
    return pickle.loads(data), fds


class WriterProcess:
    """This rank's writer process, seen from the training process (used by the save's thread only)."""

    def __init__(self, *, idle: bool):
        self.idle = idle
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.arena: Arena | None = None

    def start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = str(Path(__file__).resolve().parents[1])  # where ``trainer`` is importable from
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainer.checkpoint_writer_main", str(child.fileno()), "idle" if self.idle else "normal",
                 str(os.getpid())],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env, close_fds=True,
            )
        finally:
            child.close()
        self.sock = parent
        self.arena = None  # a new writer has mapped nothing yet

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def snapshot(self, files: dict[str, Any]) -> dict[str, Any]:
        """Copy the tensors of ``files`` (name -> object) into the arena; return the structure to send
        (slots in place of tensors). Starts the writer, and (re)builds the arena when shapes changed."""
        if not self.alive():
            self.close()
            self.start()
        tensors: list[torch.Tensor] = []
        structure = flatten(files, tensors)
        specs = _specs(tensors)
        if self.arena is None or self.arena.specs != specs:
            old, self.arena = self.arena, Arena(specs)
            _send(self.sock, ("arena", specs), [self.arena.fd])
            if old is not None:
                old.close()
        for dst, src in zip(self.arena.tensors, tensors):
            dst.copy_(src.detach())  # a device tensor is copied to the host here
        return structure

    def write(self, request: dict) -> dict:
        """Send one save (``request``: the structure, where and what to write) and wait for its reply."""
        try:
            _send(self.sock, ("save", request))
            reply, _ = _recv(self.sock)
        except (OSError, EOFError) as e:
            code = None
            if self.proc is not None:  # its end of the socket closed: it is dying, if not yet dead
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self.proc.wait(timeout=5)
            self.close()
            if code is None:
                why = getattr(e, "strerror", None) or str(e) or type(e).__name__
            else:
                why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            return {"ok": False, "info": None, "last_error": f"the checkpoint writer process died ({why})", "logs": [],
                    "died": True}
        return reply

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()  # the writer sees the end of its socket and exits
            self.sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
