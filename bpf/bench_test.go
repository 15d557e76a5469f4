package bpf

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
)

// The benchmarks report ns/pkt, the in-kernel time per program run measured
// by BPF_PROG_TEST_RUN (ns/op also counts the syscall). A test run reuses
// one skb for all repetitions, and the programs rewrite it, so each
// benchmark arranges for the rewritten packet to take the same path again.
// With -bpf.baseline each runs both objects interleaved (benchInterleaved).

// runBench runs prog over frame n times and reports the kernel's time per run.
func runBench(b *testing.B, prog *ebpf.Program, frame []byte, n int) {
	b.Helper()
	measure := repeated(b, prog, frame)
	b.ResetTimer()
	b.ReportMetric(measure(n)/float64(n), "ns/pkt")
}

// repeated measures test runs of prog over frame, n repetitions a run.
func repeated(b *testing.B, prog *ebpf.Program, frame []byte) measureFunc {
	return func(n int) float64 {
		ret, perRun, err := prog.Benchmark(frame, n, nil)
		if err != nil {
			b.Fatal(err)
		}
		if ret != tcActUnspec {
			b.Fatalf("verdict %d", int32(ret))
		}
		return float64(perRun.Nanoseconds()) * float64(n)
	}
}

// pingPong makes the egress output of an established flow another
// established flow whose output is the original packet: the SNAT address is
// also a masquerade source with a dir-0 entry back to the pod's tuple.
// The pair is made by a SYN: a mid-stream segment made none before loose
// pickup, so an earlier build would measure its skip, not a translation.
func pingPong(b *testing.B, e *testEnv, f flow) {
	syn := f
	syn.tcpFlags, syn.payload = tcpSYN, nil
	natPort := masqueradedB(b, e, syn)
	if err := e.dp.Maps.MasqSrcV4.Put(LPMKeyV4From(netip.PrefixFrom(snat4, 32)), uint8(1)); err != nil {
		b.Fatal(err)
	}
	k := NATKeyV4{Src: Addr4(snat4), Dst: Addr4(f.dst), Sport: Port(natPort), Dport: Port(f.dport), Proto: f.proto, Dir: DirEgress}
	putNATV4(b, e.dp.Maps.NatV4, k, NATValV4{Addr: Addr4(f.src), Port: Port(f.sport)})
}

// putNATV4 writes an entry into nat_v4 of this build or of an older one
// (-bpf.baseline), whose values may be shorter: the layout only grows by
// fields appended at its end.
func putNATV4(b *testing.B, m *ebpf.Map, k NATKeyV4, v NATValV4) {
	b.Helper()
	var buf bytes.Buffer
	if err := binary.Write(&buf, binary.LittleEndian, v); err != nil {
		b.Fatal(err)
	}
	if err := m.Put(k, buf.Bytes()[:m.ValueSize()]); err != nil {
		b.Fatal(err)
	}
}

func masqueradedB(b *testing.B, e *testEnv, f flow) uint16 {
	b.Helper()
	ret, out := e.run(e.dp.Egress, f.packet())
	if ret != tcActUnspec || len(out) < 14+24 {
		b.Fatalf("first packet: verdict %d", int32(ret))
	}
	return uint16(out[14+20])<<8 | uint16(out[14+21])
}

func BenchmarkEgressEstablished(b *testing.B) {
	benchInterleaved(b, envOptions{}, func(b *testing.B, e *testEnv) measureFunc {
		f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpACK, payload: make([]byte, 1400)}
		pingPong(b, e, f)
		return repeated(b, e.dp.Egress, f.packet())
	})
}

func BenchmarkEgressNotSource(b *testing.B) {
	benchInterleaved(b, envOptions{}, func(b *testing.B, e *testEnv) measureFunc {
		f := flow{src: host, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpACK, payload: make([]byte, 1400)}
		return repeated(b, e.dp.Egress, f.packet())
	})
}

// BenchmarkEgressForwardedNotSource: a forwarded packet whose source is
// neither a masquerade source nor a node address (another router's
// traffic): it pays the lookup of a former masquerade source's pair.
func BenchmarkEgressForwardedNotSource(b *testing.B) {
	benchInterleaved(b, envOptions{}, func(b *testing.B, e *testEnv) measureFunc {
		f := flow{src: netip.MustParseAddr("198.51.100.7"), dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpACK, payload: make([]byte, 1400)}
		return repeated(b, e.dp.Egress, f.packet())
	})
}

// BenchmarkEgressNonMasqDestination: a pod's mid-stream segment to a
// non-masquerade destination (pod to pod across nodes), the same flow every
// run. It has no NAT pair; its first run records the flow's decision, and
// the others pass on the record (lib/unmasq.h). An object without records
// decides every packet.
func BenchmarkEgressNonMasqDestination(b *testing.B) {
	benchInterleaved(b, envOptions{}, func(b *testing.B, e *testEnv) measureFunc {
		f := flow{src: pod1, dst: netip.MustParseAddr("192.168.1.1"), proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpACK, payload: make([]byte, 1400)}
		return repeated(b, e.dp.Egress, f.packet())
	})
}

// BenchmarkEgressNonMasqNewFlow: a new flow from a pod to a non-masquerade
// destination (pod-to-pod traffic leaving the node), a SYN of a tuple not
// seen before in every run: the cost of deciding it, and of recording the
// decision (lib/unmasq.h). Each run is a test run of its own (repeat 1), so
// the figure includes the kernel's timer reads around the run; compare it
// with the baseline's, measured the same way. 64 000 source ports times 250
// destinations: the tuples never repeat, and the records' LRU evicts once
// full, as on a busy node.
func BenchmarkEgressNonMasqNewFlow(b *testing.B) {
	benchInterleaved(b, envOptions{}, func(b *testing.B, e *testEnv) measureFunc {
		i := 0 // the runs so far: each its own tuple
		return func(n int) float64 {
			var total float64
			for end := i + n; i < end; i++ {
				dst := netip.AddrFrom4([4]byte{192, 168, byte(1 + (i/64000)%250), byte(i % 251)})
				f := flow{src: pod1, dst: dst, proto: protoTCP, sport: uint16(1024 + i%64000), dport: 443, tcpFlags: tcpSYN}
				ret, perRun, err := e.dp.Egress.Benchmark(f.packet(), 1, nil)
				if err != nil || ret != tcActUnspec {
					b.Fatalf("verdict %d, %v", int32(ret), err)
				}
				total += float64(perRun.Nanoseconds())
			}
			return total
		}
	})
}

// BenchmarkEgressNewFlow: with the SNAT address a masquerade source, every
// run sees a new tuple (the previous run's output) and creates a NAT pair.
// The NAT map is emptied every chunk so that port probing stays short, as in
// a table that the collector keeps from filling up (interleaveChunk runs
// at most between two clears).
func BenchmarkEgressNewFlow(b *testing.B) {
	benchInterleaved(b, envOptions{natMax: 4 * interleaveChunk, portMin: 1024, portMax: 65535}, newFlow)
}

// benchNewFlow reports the new masqueraded flow's ns/pkt on e alone, the
// NAT map emptied every chunk runs.
func benchNewFlow(b *testing.B, e *testEnv, chunk int) {
	measure := newFlow(b, e)
	var total float64
	b.ResetTimer()
	for done := 0; done < b.N; done += chunk {
		total += measure(min(chunk, b.N-done))
	}
	b.ReportMetric(total/float64(b.N), "ns/pkt")
}

// newFlow sets up BenchmarkEgressNewFlow's path on e: each measure runs
// the egress program n times, checks that every run made a NAT pair, and
// ends every pair as the collector does (outside the kernel's time).
func newFlow(b *testing.B, e *testEnv) measureFunc {
	if err := e.dp.Maps.MasqSrcV4.Put(LPMKeyV4From(netip.PrefixFrom(snat4, 32)), uint8(1)); err != nil {
		b.Fatal(err)
	}
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
	frame := f.packet()
	return func(n int) float64 {
		before := e.counters()[CounterNATNew]
		ret, perRun, err := e.dp.Egress.Benchmark(frame, n, nil)
		if err != nil || ret != tcActUnspec {
			b.Fatalf("verdict %d, %v", int32(ret), err)
		}
		if got := e.counters()[CounterNATNew] - before; got < uint64(n) {
			b.Fatalf("%d new NAT pairs for %d runs", got, n)
		}
		endPairs(b, e)
		return float64(perRun.Nanoseconds()) * float64(n)
	}
}

// endPairs ends every pair of e's nat_v4 through the collector's program
// (EndPairV4, forced), which also clears each pair's early-drop note
// (lib/natgc.h): emptied from user space, the notes of pairs long gone
// would fill their array, and every new pair's note would probe past
// them, a state no node reaches while the collector runs.
func endPairs(b *testing.B, e *testEnv) {
	var keys []NATKeyV4
	var k NATKeyV4
	var v NATValV4
	it := e.dp.Maps.NatV4.Iterate()
	for it.Next(&k, &v) {
		if k.Dir == DirEgress {
			keys = append(keys, k)
		}
	}
	if err := it.Err(); err != nil {
		b.Fatal(err)
	}
	for _, k := range keys {
		if r, err := e.dp.EndPairV4(k, true); err != nil || r == GCKept {
			b.Fatalf("end pair %+v: %v, %v", k, r, err)
		}
	}
	clearMap(b, e.dp.Maps.NatV4) // nothing left but half pairs, if any
}

// clearMap empties nat_v4 map m.
func clearMap(tb testing.TB, m *ebpf.Map) {
	var keys []NATKeyV4
	var k NATKeyV4
	var v NATValV4
	it := m.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, k)
	}
	if err := it.Err(); err != nil {
		tb.Fatal(err)
	}
	if len(keys) == 0 {
		return
	}
	if _, err := m.BatchDelete(keys, nil); err != nil {
		tb.Fatal(err)
	}
}

// BenchmarkIngressReply: the translated reply is itself a reply of another
// flow that translates it back.
func BenchmarkIngressReply(b *testing.B) {
	benchInterleaved(b, envOptions{}, ingressReply)
}

func ingressReply(b *testing.B, e *testEnv) measureFunc {
	f := flow{src: pod1, dst: remote4, proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}
	natPort := masqueradedB(b, e, f) // the pair (see pingPong)
	f.tcpFlags = tcpACK
	k := NATKeyV4{Src: Addr4(remote4), Dst: Addr4(pod1), Sport: Port(443), Dport: Port(40000), Proto: protoTCP, Dir: DirIngress}
	putNATV4(b, e.dp.Maps.NatV4, k, NATValV4{Addr: Addr4(snat4), Port: Port(natPort)})
	r := reply(f, snat4, natPort)
	r.payload = make([]byte, 1400)
	return repeated(b, e.dp.Ingress, r.packet())
}
