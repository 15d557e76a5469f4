package bpf

import "os"

// IPMASQ_TEST_DATAPATH_VARIANT=compat runs the package's tests on the
// compat variant where the kernel would get the full one (Load's default).
func init() {
	testVariant = Variant(os.Getenv("IPMASQ_TEST_DATAPATH_VARIANT"))
}
