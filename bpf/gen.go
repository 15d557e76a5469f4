package bpf

// The generated files (masq_bpfel.go, masq_bpfel.o) are committed, so that
// building the agent needs no clang. Regenerate with `go generate ./bpf/`
// (clang and libbpf-dev's headers needed). masq.c holds the SEC programs
// only; the code is in lib/*.h, one concern each. The first step,
// checkheaders.sh, compiles every header on its own, so that each stays
// self-contained (includes what it uses). masqcompat is the same source
// built for kernels from 5.10 on (lib/compat.h, variant.go). The last builds testdata/natstate.o,
// the test program that holds StateOf to nat_state(). mapcount.c, a
// bpf_map iterator of its own object, reads the kernel's element counts.
//
//go:generate ./checkheaders.sh
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -target bpfel -cflags "-O2 -g -Wall -Werror" masq masq.c -- -I./include
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -target bpfel -cflags "-O2 -g -Wall -Werror -DIPMASQ_COMPAT" masqcompat masq.c -- -I./include
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -target bpfel -cflags "-O2 -g -Wall -Werror" mapcount mapcount.c -- -I./include
//go:generate sh -c "clang -target bpf -O2 -g -Wall -Werror -fdebug-prefix-map=$DOLLAR{PWD}=. -I./include -c testdata/natstate.c -o testdata/natstate.o && llvm-strip -g testdata/natstate.o"
