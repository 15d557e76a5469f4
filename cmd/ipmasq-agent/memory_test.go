package main

import (
	"log/slog"
	"runtime/debug"
	"runtime/metrics"
	"testing"
)

func TestMemoryReleaserWaitsForTheBurstToEnd(t *testing.T) {
	r, counter, released := countingReleaser()
	steps := []struct {
		what     string
		alloc    uint64 // allocated since the previous check
		released bool
	}{
		{"start: loading a large config", 40 << 20, false},
		{"still loading", 30 << 20, false},
		{"still busy, just above quiet", quietBytes + 1, false},
		{"quiet: the burst is over", 64 << 10, true},
		{"quiet again: nothing new to release", 64 << 10, false},
		{"idle trickle", quietBytes, false},
		{"a burst smaller than burstBytes", burstBytes / 2, false},
		{"quiet after it", 0, false},
		{"the trickles add up to a burst", burstBytes / 2, false},
		{"quiet", 0, true},
	}
	for _, s := range steps {
		*counter += s.alloc
		before := *released
		if got := r.check(); got != s.released || (*released > before) != s.released {
			t.Fatalf("%s: check() = %v (release called %d times), want %v", s.what, got, *released-before, s.released)
		}
	}
}

// TestMemoryReleaserReturnsAGarbageBurst: with the runtime's own counter,
// a burst of garbage is followed by one release that returns it to the
// kernel (the released heap grows by most of it).
func TestMemoryReleaserReturnsAGarbageBurst(t *testing.T) {
	r := newMemoryReleaser(slog.New(slog.DiscardHandler))
	r.check() // start counting from here
	releasedBytes := func() uint64 {
		s := []metrics.Sample{{Name: "/memory/classes/heap/released:bytes"}}
		metrics.Read(s)
		return s[0].Value.Uint64()
	}
	var keep [][]byte
	for range 64 {
		b := make([]byte, 1<<20)
		for i := range b {
			b[i] = 1 // resident
		}
		keep = append(keep, b)
	}
	if r.check() {
		t.Fatal("released while the burst was still allocating")
	}
	keep = nil // garbage now
	before := releasedBytes()
	if !r.check() {
		t.Fatal("no release after a 64 MiB burst ended")
	}
	if got := releasedBytes() - before; got < 32<<20 {
		t.Fatalf("released heap grew by %d MiB after a 64 MiB burst, want most of it", got>>20)
	}
}

// TestMemoryReleaserReturnsASmallBurst: the ~10 MiB that 300 allocations
// over the API allocate (measured with 10 000 endpoints, issue #14) are
// released once they end; with the live heap at 20 MiB the runtime would
// otherwise keep them resident until it next collects.
func TestMemoryReleaserReturnsASmallBurst(t *testing.T) {
	r, counter, released := countingReleaser()
	r.check()
	for range 5 { // 2 MiB per check: busy
		*counter += 2 << 20
		if r.check() {
			t.Fatal("released while the allocations were still coming")
		}
	}
	if !r.check() {
		t.Fatal("no release once 10 MiB of allocations ended")
	}
	if *released != 1 {
		t.Fatalf("release called %d times, want 1", *released)
	}
}

// countingReleaser is a memoryReleaser that reads its allocation counter
// from *counter and counts its releases in *released.
func countingReleaser() (r *memoryReleaser, counter *uint64, released *int) {
	counter, released = new(uint64), new(int)
	r = &memoryReleaser{
		allocated: func() uint64 { return *counter },
		release:   func() { *released++ },
	}
	return r, counter, released
}

// TestGCPercent: the agent's GOGC is gcPercent unless the environment
// sets one, which is left as the runtime applied it.
func TestGCPercent(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	defer debug.SetGCPercent(debug.SetGCPercent(100))

	setGCPercent(log, func(string) (string, bool) { return "", false })
	if got := debug.SetGCPercent(100); got != gcPercent {
		t.Errorf("without GOGC: GC percent %d, want %d", got, gcPercent)
	}
	setGCPercent(log, func(name string) (string, bool) { return "150", name == "GOGC" })
	if got := debug.SetGCPercent(100); got != 100 {
		t.Errorf("with GOGC=150 in the environment: GC percent changed to %d, want it left alone", got)
	}
}
