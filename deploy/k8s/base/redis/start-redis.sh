#!/bin/sh
# Start redis-server for the sentinel control bus with two ACL users, passwords read from files:
#   default   operators only (all commands); password: $REDIS_ADMIN_PASSWORD_FILE
#   sentinel  trainer + sentinel daemon + CLI: keys sentinel:* only, no admin/dangerous
#             commands, no pub/sub; password: $REDIS_PASSWORD_FILE
# The ACL file stores only SHA-256 hashes (#<hex>), never a plaintext password, and no password
# ever appears on a command line.  Usage: start-redis.sh [extra redis-server args...]
set -eu

conf="${REDIS_CONF:-/etc/redis/redis.conf}"
acl="${REDIS_ACL_FILE:-/tmp/users.acl}"

hash_secret() {
  # $1 = file; prints the sha256 of its content without the trailing newline
  if [ ! -r "$1" ]; then
    echo "start-redis.sh: secret file $1 is not readable" >&2
    exit 78
  fi
  pw="$(cat "$1")"
  if [ -z "$pw" ]; then
    echo "start-redis.sh: secret file $1 is empty" >&2
    exit 78
  fi
  printf '%s' "$pw" | sha256sum | cut -d' ' -f1
}

admin_hash="$(hash_secret "${REDIS_ADMIN_PASSWORD_FILE:-/run/secrets/redis_admin_password}")"
user_hash="$(hash_secret "${REDIS_PASSWORD_FILE:-/run/secrets/redis_password}")"

umask 077
cat >"$acl" <<ACL
user default on #${admin_hash} ~* &* +@all
user sentinel on #${user_hash} resetkeys ~sentinel:* resetchannels -@all +@connection +@read +@write +@stream +@transaction +eval +evalsha -@dangerous
ACL

exec redis-server "$conf" --aclfile "$acl" "$@"
