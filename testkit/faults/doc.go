// Package faults injects kernel write failures into the agent's reconcilers,
// to test that they retry with backoff, report degraded health while
// failing, converge once the fault clears, and do not hold up each other.
//
// It is test and chaos tooling, never imported by production code (the
// architecture test checks it). Each reconciler provides its Operations in
// the hive; Decorate wraps them with Wrap (and WrapBatch) under their fault
// points, the way statedb's reconciler example decorates its operations.
//
// A script test provides an Injector and drives it:
//
//	faults/fail nonmasq-maps 'map write refused'
//	config/write more.yaml
//	db/cmp nonmasq-cidrs failing.table   # the new row shows Error: map write refused
//	faults/clear nonmasq-maps
//	db/cmp nonmasq-cidrs done.table
package faults
