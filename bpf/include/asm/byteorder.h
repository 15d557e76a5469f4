/* bpf2go builds for bpfel only. */
#include <linux/byteorder/little_endian.h>
