// Package faults injects kernel write failures into the agent's reconcilers,
// to test that they retry with backoff, report degraded health while
// failing, converge once the fault clears, and do not hold up each other.
//
// It is test and chaos tooling: it is inert unless an *Injector is in the
// hive. Each reconciler registration takes an optional *Injector and wraps
// its Operations with Wrap (and WrapBatch) under its fault point; without an
// Injector the wrappers return the operations unchanged, so production runs
// the kernel writers directly.
//
// A script test provides an Injector and drives it:
//
//	faults/fail nonmasq-maps 'map write refused'
//	config/write more.yaml
//	db/cmp nonmasq-cidrs failing.table   # the new row shows Error: map write refused
//	faults/clear nonmasq-maps
//	db/cmp nonmasq-cidrs done.table
package faults
