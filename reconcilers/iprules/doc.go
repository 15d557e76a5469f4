// Package iprules reconciles the ip-rules table into the kernel's policy
// routing rules: one "priority: from <endpoint> to <CIDR> lookup <table>"
// per row, in both address families.
//
// Every rule it installs carries a dedicated rtnetlink protocol ([Protocol]),
// and it only ever lists, compares and deletes rules with that protocol, so
// pruning never touches a rule the agent did not make, even one with the
// same priority and selectors.
//
// [Ops] keeps an in-memory copy of the owned rules, loaded from the kernel
// by the first operation and reloaded by every Prune (drift repair). Update
// and Delete consult it before writing, so an agent restarting over a kernel
// that is already right makes zero writes, and a configuration change makes
// exactly the rules that differ.
//
// The reconciler hands Ops its changes in batches (UpdateBatch,
// DeleteBatch). Through the agent's Target ([NewNetlinkTargetAt]) a batch
// is written as up to 256 rule requests per datagram on one rtnetlink
// socket, and each ack is matched to its request by sequence number, so a
// rule the kernel refuses fails alone and is retried alone.
package iprules
