"""An async save's writer process (``trainer/checkpoint_writer.py`` says why and how): it maps the arena the
training process shares, rebuilds each save's files over it, and writes them as a sync save would.

    python -m trainer.checkpoint_writer_main FD {idle,normal} PARENT_PID   (started by ``WriterProcess``, not by hand)
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import signal
import socket
import sys
from pathlib import Path

import torch

from trainer.checkpoint import Checkpointer
from trainer.checkpoint_writer import _layout, _recv, _send, _views, fill


def _serve(sock: socket.socket) -> None:
    tensors: list[torch.Tensor] = []
    buf: mmap.mmap | None = None
    while True:
        try:
            msg, fds = _recv(sock)
        except EOFError:
            return
        if msg[0] == "arena":
            specs = msg[1]
            offsets, size = _layout(specs)
            tensors = []  # the old views go before their mapping
            if buf is not None:
                with contextlib.suppress(BufferError):
                    buf.close()
            buf = mmap.mmap(fds[0], size) if size else None
            for fd in fds:
                os.close(fd)
            tensors = _views(buf, specs, offsets)
            continue
        req = msg[1]
        logs: list[str] = []
        ck = Checkpointer(Path(req["run_dir"]), rank=req["rank"], world_size=req["world_size"], keep_last=req["keep_last"],
                          keep_every=req["keep_every"], barrier=lambda: None, all_ok=lambda ok: ok, log=logs.append,
                          hash_thread=req["hash_thread"])
        reply: dict = {"ok": False, "info": None, "last_error": None, "logs": logs}
        try:
            reply.update(ck.write_async_files(Path(req["tmp"]), req["step"], req["meta"],
                                              fill(req["shared"], tensors), fill(req["per_rank"], tensors)))
        except Exception as e:  # noqa: BLE001 - said in one line, to the training process
            reply["last_error"] = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0]
        reply["last_error"] = reply["last_error"] or ck.last_error
        _send(sock, reply)


def _die_with(parent: int) -> bool:
    """Be killed when the training process is (Linux: the parent-death signal), so that no save of a
    killed run commits after it, beside its successor. False: the parent is already gone."""
    with contextlib.suppress(AttributeError, OSError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    return os.getppid() == parent


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not argv[0].isdigit() or not argv[2].isdigit():
        print("trainer.checkpoint_writer_main: started by an async save (trainer/checkpoint_writer.py), not by hand", file=sys.stderr)
        return 2
    if not _die_with(int(argv[2])):
        return 0
    if argv[1] == "idle":
        with contextlib.suppress(AttributeError, OSError):  # not Linux: normal priority
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    torch.set_num_threads(1)
    sock = socket.socket(fileno=int(argv[0]))
    try:
        _serve(sock)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
