package tables

// DatapathVariant says which build of the datapath's object the agent
// loads and why (bpf.ChooseVariant: the full one where the kernel has
// every feature it uses, else the compat one for kernels from 5.10), with
// the attach mode asked for (--tc-attach-mode). The datapath
// (reconcilers/datapath) provides it, from a probe of the kernel when the
// agent starts; status and metrics show it. Empty: no datapath.
type DatapathVariant struct {
	Variant    string
	Reason     string
	AttachMode string
}
