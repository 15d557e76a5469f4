/* BPF has no arch headers: use the generic definitions (64-bit, little endian for bpfel). */
#include <asm-generic/bitsperlong.h>
