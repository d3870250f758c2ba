#!/bin/sh
# Installs the Debian packages nflash needs, only those that are missing.
# Run by `make deps`, which `make`, `make test`, `make demo` and `make bench`
# depend on, so a fresh Debian 12 machine needs nothing else.
# ARCH=arm64 on a machine that is not arm64 (make ... ARCH=arm64) adds the
# cross toolchain, qemu-user and the arm64 dev packages through multiarch.
PKGS="build-essential libaio-dev liburing-dev libnuma-dev libbpf-dev libelf-dev \
zlib1g-dev libcriterion-dev bpftool clang llvm pkg-config fio gnuplot-nox \
libjansson-dev libmicrohttpd-dev libcurl4-openssl-dev curl"

host=$(dpkg --print-architecture)
cross=""
# Criterion's arm64 runtime is unpacked into CRIT_ARM64 instead: its
# libnanomsg5 is not Multi-Arch, so installing libcriterion-dev:arm64 would
# remove the x86-64 Criterion (the headers are the same; the x86-64
# libcriterion-dev provides them).
CRIT_ARM64=${CRIT_ARM64:-/opt/nflash-arm64}
if [ "${ARCH:-}" = arm64 ] && [ "$host" != arm64 ]; then
	cross=1
	PKGS="$PKGS gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static libc6:arm64 \
libaio-dev:arm64 liburing-dev:arm64 libnuma-dev:arm64 libbpf-dev:arm64 libgit2-1.5:arm64 libffi8:arm64 \
libjansson-dev:arm64 libmicrohttpd-dev:arm64 libcurl4-openssl-dev:arm64"
fi

crit_arm64() {
	[ -z "$cross" ] && return 0
	[ -e "$CRIT_ARM64/usr/lib/aarch64-linux-gnu/libcriterion.so.3" ] && return 0
	echo "deps: unpacking Criterion for arm64 into $CRIT_ARM64" >&2
	tmp=$(mktemp -d) || return 1
	chmod 755 "$tmp"
	( cd "$tmp" && apt-get -o APT::Sandbox::User=root download libcriterion3:arm64 libnanomsg5:arm64 >&2 ) &&
		$SUDO mkdir -p "$CRIT_ARM64" &&
		for d in "$tmp"/*.deb; do $SUDO dpkg -x "$d" "$CRIT_ARM64" || exit 1; done
	rc=$?
	rm -rf "$tmp"
	[ $rc = 0 ] || echo "deps: could not unpack Criterion for arm64 into $CRIT_ARM64" >&2
	return $rc
}

SUDO=
if [ "$(id -u)" != 0 ]; then
	SUDO=sudo
fi
missing=""
for p in $PKGS; do
	# Criterion for this machine's architecture: an arm64 copy installed by
	# hand (it cannot sit beside this one) must not count
	q=$p
	[ "$p" = libcriterion-dev ] && q=$p:$host
	dpkg-query -W -f='${Status}' "$q" 2>/dev/null | grep -q 'ok installed' || missing="$missing $q"
done
[ -z "$missing" ] && { crit_arm64; exit $?; }

echo "deps: installing$missing" >&2
if [ -n "$SUDO" ]; then
	command -v sudo >/dev/null 2>&1 || { echo "deps: not root and no sudo; install:$missing" >&2; exit 1; }
fi
export DEBIAN_FRONTEND=noninteractive
if [ -n "$cross" ] && ! dpkg --print-foreign-architectures | grep -qx arm64; then
	$SUDO dpkg --add-architecture arm64 || { echo "deps: dpkg --add-architecture arm64 failed" >&2; exit 1; }
fi
$SUDO apt-get update -qq >&2 || { echo "deps: apt-get update failed" >&2; exit 1; }
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing >&2 || {
	echo "deps: apt-get install failed for:$missing" >&2; exit 1; }
crit_arm64
