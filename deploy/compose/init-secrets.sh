#!/usr/bin/env bash
# Create the compose secrets (random, 256-bit hex) in ./secrets, once. Existing files are kept:
# rotating the HMAC secret or a Redis password means restarting every service that uses it.
#
# The directory is 0700 (other host users cannot reach the files). The files are 0444 because
# compose bind-mounts them with their host mode and the containers run as different non-root
# users (trainer/sentinel 10001, redis 999, grafana 472) that must be able to read them.
set -euo pipefail
cd "$(dirname "$0")"
umask 077
mkdir -p secrets
chmod 700 secrets
for name in sentinel_secret redis_password redis_admin_password grafana_admin_password; do
  f="secrets/$name"
  if [[ -s "$f" ]]; then
    echo "kept    $f"
    continue
  fi
  if command -v openssl >/dev/null 2>&1; then
    openssl rand -hex 32 >"$f"
  else
    python3 -c 'import secrets; print(secrets.token_hex(32))' >"$f"
  fi
  chmod 444 "$f"
  echo "created $f"
done
