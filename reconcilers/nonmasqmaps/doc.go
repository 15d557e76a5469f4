// Package nonmasqmaps reconciles the nonmasq-cidrs table into the pinned
// LPM tries <bpf-root>/ipmasq/nonmasq_v4 and nonmasq_v6 that the datapath
// consults for every new flow: key {u32 prefixlen; addr} (address in network
// byte order), value u8 action (0 = do not masquerade, 1 = masquerade).
//
// The tries are loaded and pinned with the rest of the datapath by its
// loader (reconcilers/datapath), their one owner; this package writes them
// through bpfmap.Ops over the loaded datapath (datapath.Handle), as
// reconcilers/masqsources writes masq_src_v4/v6, and prints them from the
// pins (Format, through bpf.Pinned). They are never flushed: on start the agent reopens them,
// writes only the entries that differ from the table and prunes the rest
// once the table is initialized, so a restart leaves a correct map
// untouched and the datapath never sees an empty one. The full comparison
// with the kernel also runs every resyncInterval to repair drift.
//
// The reconciler is statedb's, registered as every datapath map's
// (datapath.RegisterBatched): a Done or Error status on every row, failed
// rows retried alone with backoff, WaitUntilReconciled (maps/dump waits on
// it), reconciler.Metrics, the health of job-reconcile-nonmasq-maps, a
// prune when the table is initialized, hourly, every resyncInterval of the
// applied config (resyncLoop) and on request (maps/resync), and the
// Operations/BatchOperations taken from the hive so that tests decorate
// them (testkit/faults). Its rounds take up to 4 × max-nonmasq-
// cidrs rows, so that a new config of 16 384 prefixes, every old one
// deleted and every new one written, is one batch write per map and one
// status commit. Within a round the new prefixes are written before the
// old ones are deleted (newBeforeOld), so that while a config changes
// every destination keeps its old decision or has its new one.
package nonmasqmaps
