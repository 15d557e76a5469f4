package datapath

import (
	"fmt"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/tables"
)

// newVariant picks the build of the programs the agent loads
// (--datapath-variant, bpf.ChooseVariant) from a probe of the kernel, when
// the hive is built: a kernel no build can run on is one error naming its
// release and what it lacks, and the agent exits before anything is
// loaded or attached.
func newVariant(cfg Config) (tables.DatapathVariant, error) {
	return chooseVariant(cfg, bpf.ProbeKernel())
}

func chooseVariant(cfg Config, f bpf.KernelFeatures) (tables.DatapathVariant, error) {
	want, err := bpf.ParseVariant(cfg.DatapathVariant)
	if err != nil {
		return tables.DatapathVariant{}, fmt.Errorf("--datapath-variant: %w", err)
	}
	c, err := bpf.ChooseVariant(want, f)
	if err != nil {
		return tables.DatapathVariant{}, err
	}
	return tables.DatapathVariant{Variant: string(c.Variant), Reason: c.Reason, AttachMode: cfg.TCAttachMode}, nil
}

// kernelRelease is the running kernel's release, for the start log.
func kernelRelease() string { return bpf.ProbeKernelRelease() }
