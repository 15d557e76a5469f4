package bpf

// The generated files (masq_bpfel.go, masq_bpfel.o) are committed, so that
// building the agent needs no clang. Regenerate with `go generate ./bpf/`
// (clang and libbpf-dev's headers needed). masq.c holds the SEC programs
// only; the code is in lib/*.h, one concern each. The first step compiles
// every header on its own, so that each stays self-contained (includes what
// it uses).
//
//go:generate sh -c "for h in lib/*.h; do clang -target bpf -O2 -Wall -Werror -Wno-unused-function -I./include -fsyntax-only -x c $DOLLAR{h} || exit 1; done"
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -target bpfel -cflags "-O2 -g -Wall -Werror" masq masq.c -- -I./include
