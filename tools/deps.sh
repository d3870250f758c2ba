#!/bin/sh
# Installs the Debian packages nflash needs, only those that are missing.
# Run by `make deps`, which `make`, `make test`, `make demo` and `make bench`
# depend on, so a fresh Debian 12 machine needs nothing else.
PKGS="build-essential libaio-dev liburing-dev libnuma-dev libbpf-dev libelf-dev \
zlib1g-dev libcriterion-dev bpftool clang llvm pkg-config fio gnuplot-nox \
libjansson-dev libmicrohttpd-dev libcurl4-openssl-dev curl"

missing=""
for p in $PKGS; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing="$missing $p"
done
[ -z "$missing" ] && exit 0

echo "deps: installing$missing" >&2
if [ "$(id -u)" != 0 ]; then
	SUDO=sudo
	command -v sudo >/dev/null 2>&1 || { echo "deps: not root and no sudo; install:$missing" >&2; exit 1; }
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >&2 || { echo "deps: apt-get update failed" >&2; exit 1; }
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing >&2 || {
	echo "deps: apt-get install failed for:$missing" >&2; exit 1; }
