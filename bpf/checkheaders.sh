#!/bin/sh
# Compiles every header of lib/ on its own, so that each stays
# self-contained (includes what it uses). The family templates (*_fam.h)
# are compiled once per family, as their includers do (see lib/family.h).
# Run by go generate (gen.go), from this directory.
set -e
for h in lib/*.h; do
	case $h in
	*_fam.h) defs="-DFAMILY=4 -DFAMILY=6" ;;
	*) defs="-UFAMILY" ;;
	esac
	for d in $defs; do
		clang -target bpf -O2 -Wall -Werror -Wno-unused-function -I./include \
			-fsyntax-only "$d" -x c "$h"
	done
done
