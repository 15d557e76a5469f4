// Package nonmasqmaps reconciles the nonmasq-cidrs table into the pinned
// LPM tries <bpf-root>/ipmasq/nonmasq_v4 and nonmasq_v6 that the datapath
// consults for every new flow: key {u32 prefixlen; addr} (address in network
// byte order), value u8 action (0 = do not masquerade, 1 = masquerade).
//
// The tries are loaded and pinned with the rest of the datapath by its
// loader (reconcilers/datapath), their one owner; this package writes them
// through the loaded Datapath (datapath.MapOps), as reconcilers/masqsources
// writes masq_src_v4/v6, and prints them from the pins (Format, through
// bpf.Pinned). They are never flushed: on start the agent reopens them,
// writes only the entries that differ from the table and prunes the rest
// once the table is initialized, so a restart leaves a correct map
// untouched and the datapath never sees an empty one. The full comparison
// with the kernel also runs every resyncInterval to repair drift.
//
// The reconciler is this package's own (mapReconciler), not statedb's
// generic one: a config of 16 384 prefixes is one table transaction and
// one batch write per map, and the generic reconciler's per-row clones,
// growing batches and result map were a third of the time from the file
// to the maps. It keeps the generic one's contract: a Done or
// Error status on every row, retries with backoff, WaitUntilReconciled,
// reconciler.Metrics, health, and the Operations/BatchOperations taken
// from the hive so that tests decorate them.
package nonmasqmaps
