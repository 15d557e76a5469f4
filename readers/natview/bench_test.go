package natview

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/testkit/natfill"
	"github.com/ipmasq/ipmasq/testkit/netnstest"
)

// BenchmarkNATScale: nat -C and the listing of n idle pairs against
// conntrack -C and conntrack -L (conntrack-tools) of n conntrack entries
// in a namespace of its own, alternated in the same run. conntrack's side
// is capped at natfill.ConntrackMax entries (nf_conntrack_max); the
// listing's ratio is then per entry. nat -C runs in process here (the
// shell's datapath/nat), conntrack -C is a process of its own: its
// figure is mostly the process's start.
//
//	go test -run '^$' -bench NATScale -benchtime 5x ./readers/natview/
func BenchmarkNATScale(b *testing.B) {
	bin, err := exec.LookPath("conntrack")
	if err != nil {
		b.Fatalf("conntrack (Debian package conntrack) is needed for the baseline: %v", err)
	}
	for _, flows := range natfill.Sizes {
		b.Run(fmt.Sprintf("flows=%d", flows), func(b *testing.B) {
			_, src := natfill.Datapath(b, flows, time.Minute)
			ns, entries := natfill.Conntrack(b, flows)
			conntrack := func(arg string) func() error {
				return func() error {
					cmd := exec.Command(bin, arg)
					cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
					return netnstest.Do(ns, cmd.Run)
				}
			}
			b.Run("count", func(b *testing.B) {
				natfill.Compare(b, flows, entries, false,
					func() error { return Run(io.Discard, src, []string{"-C"}) }, conntrack("-C"))
			})
			// The kernel's count, which conntrack -C prints, read in process.
			b.Run("count-in-process", func(b *testing.B) {
				natfill.Compare(b, flows, entries, false,
					func() error { return Run(io.Discard, src, []string{"-C"}) },
					func() error {
						return netnstest.Do(ns, func() error {
							_, err := os.ReadFile("/proc/sys/net/netfilter/nf_conntrack_count")
							return err
						})
					})
			})
			b.Run("list", func(b *testing.B) {
				natfill.Compare(b, flows, entries, true,
					func() error { return Run(io.Discard, src, nil) }, conntrack("-L"))
			})
		})
	}
}
