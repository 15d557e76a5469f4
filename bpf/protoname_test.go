package bpf

import "testing"

func TestProtoName(t *testing.T) {
	for p, want := range map[uint8]string{6: "tcp", 17: "udp", 1: "icmp", 58: "icmpv6", 132: "sctp", 47: "proto-47"} {
		if got := ProtoName(p); got != want {
			t.Errorf("ProtoName(%d) = %q, want %q", p, got, want)
		}
	}
}
