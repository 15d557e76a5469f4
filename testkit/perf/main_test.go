package perf

import (
	"os"
	"testing"
)

// TestMain runs a traffic process instead of the benchmarks when the
// benchmark started this binary again with RoleEnv set.
func TestMain(m *testing.M) {
	if role := os.Getenv(RoleEnv); role != "" {
		os.Exit(RunRole(role))
	}
	os.Exit(m.Run())
}
