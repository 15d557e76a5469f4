#!/bin/sh
# deps.sh: the Debian packages the tests need, installed once. Used by
# "make test" and .ci/run, so that "make test" on a fresh clone is the
# whole set-up.
#
#   make                         the README's commands
#   iproute2                     tc: the migration test prepares a node's uplink
#                                as docs/deploy.md says (kernels without tcx)
#   iptables                     Linux MASQUERADE: the reference every datapath
#                                e2e test and the differential test against the
#                                Kubernetes agent's rules run first
#   etcd-server                  storage of the real kube-apiserver the
#                                Kubernetes tests start on loopback
#   containerd, runc,            the real node (testkit/kubetest): a
#   containernetworking-plugins  container runtime and CNI plugins
#   conntrack                    conntrack -L, the reference the NAT listing
#                                is checked and benchmarked against
#   qemu-user                    qemu-aarch64: the image's arm64 binary runs
#                                under it (tools/mkimage)
#   qemu-system-x86              the kernel matrix (testkit/kernelmatrix):
#                                Debian's 5.10, 6.1 and 6.12 kernels booted under
#                                qemu-system-x86_64 (TCG) with qboot
#   kmod                         depmod for the fetched kernels' modules on the
#                                host, modprobe in the guests (which run the
#                                host's root filesystem)
#   xz-utils, zstd               the uncompressed kernel out of each bzImage
#
# As root, what is missing is installed with one line saying so; otherwise
# one line names the missing packages and the exit status is 1. Nothing is
# printed when everything is there.
set -eu

packages="make iproute2 iptables etcd-server containerd runc containernetworking-plugins conntrack qemu-user qemu-system-x86 kmod xz-utils zstd"

if ! command -v dpkg-query >/dev/null 2>&1; then
	echo "deps: not a Debian system (no dpkg-query): install by hand: $packages" >&2
	exit 1
fi
missing=""
for p in $packages; do
	case "$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null)" in
	ii*) ;;
	*) missing="$missing $p" ;;
	esac
done
missing="${missing# }"
[ -z "$missing" ] && exit 0

if [ "$(id -u)" != 0 ]; then
	echo "deps: missing Debian packages: $missing (as root: apt-get install $missing, or run make test as root)" >&2
	exit 1
fi
echo "deps: installing missing Debian packages (once): $missing"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086 # one word per package
if ! { apt-get update -qq && apt-get install -y -qq $missing; } >"$log" 2>&1; then
	cat "$log" >&2
	echo "deps: apt-get install $missing failed (output above)" >&2
	exit 1
fi
