/* No arch-specific byte swapping for BPF: linux/swab.h falls back to the generic code. */
