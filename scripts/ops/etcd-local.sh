#!/usr/bin/env bash
# etcd from Debian's packages, for the launcher.store=etcd tests (tests/etcd_cluster.py starts the members).
#   scripts/ops/etcd-local.sh install     install etcd-server, etcd-client and openssl if missing (root, apt-get)
# The members are not started here: each test starts its own cluster on namespace hosts, with certificates made
# for that run, and stops it after.
# No etcd user or role is made either: a user per job, limited to its prefix, is what a shared cluster wants, and
# docs/multi-host.md#another-job-on-the-same-etcd gives the etcdctl commands (the job logs in with
# launcher.etcd.user and launcher.etcd.password_file; tests/test_etcd_store.py's etcd_auth fixture runs them).
set -euo pipefail
die() { echo "etcd-local: $*" >&2; exit 1; }
[ "${1:-}" = install ] || die "usage: scripts/ops/etcd-local.sh install"
missing=()
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
[ ${#missing[@]} -eq 0 ] && exit 0
command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get to install them"
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
apt=(apt-get install -y -qq --no-install-recommends -o Dpkg::Use-Pty=0 "${missing[@]}")
if ! "${apt[@]}" >>"$log" 2>&1; then
  apt-get update -qq >>"$log" 2>&1 || true
  "${apt[@]}" >>"$log" 2>&1 || { tail -n 20 "$log" >&2; die "apt-get install ${missing[*]} failed"; }
fi
# The package enables a system service; the tests' members run on their own ports per host, so none is wanted.
pkill -x etcd 2>/dev/null || true
echo "etcd-local: installed ${missing[*]}"
