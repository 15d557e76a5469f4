package datapath

// Attach modes (--tc-attach-mode), carried out by reconcilers/tcattach.
const (
	// AttachAuto uses tcx where the kernel has it (6.6+), clsact otherwise.
	AttachAuto = "auto"
	// AttachTCX always uses tcx links.
	AttachTCX = "tcx"
	// AttachClsact always uses clsact qdisc filters.
	AttachClsact = "clsact"
)
