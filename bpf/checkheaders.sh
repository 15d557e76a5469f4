#!/bin/sh
# Compiles every header of lib/ on its own, so that each stays
# self-contained (includes what it uses). A family template (*_fam.h) is
# compiled through the header that includes it, once per family (see
# lib/family.h). Each is compiled for both builds (lib/compat.h). Run by go
# generate (gen.go), from this directory.
set -e
for h in lib/*.h; do
	case $h in
	*_fam.h) continue ;;
	esac
	for d in "" -DIPMASQ_COMPAT; do
		clang -target bpf -O2 -Wall -Werror -Wno-unused-function $d -I./include -fsyntax-only -x c "$h"
	done
done
