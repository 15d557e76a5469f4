package bpf

import "encoding/binary"

// replyIndex holds the reply entries of one partition of a NAT map by key
// while the listing joins them to their egress entries (readNATPairs): an
// open-addressing table with linear probing, kept at most half full and
// reused from one partition to the next.
type replyIndex[K comparable] struct {
	slots []replySlot[K]
	n     int
	hash  func(K) uint64
}

// replySlot is one slot of a replyIndex; used=false: empty.
type replySlot[K comparable] struct {
	key  K
	info replyInfo
	used bool
}

// newReplyIndex returns an index sized for n entries (it grows past them).
func newReplyIndex[K comparable](n int, hash func(K) uint64) *replyIndex[K] {
	size := 16
	for size < 2*n {
		size *= 2
	}
	return &replyIndex[K]{slots: make([]replySlot[K], size), hash: hash}
}

// reset empties the index and sizes it for n entries.
func (x *replyIndex[K]) reset(n int) {
	size := 16
	for size < 2*n {
		size *= 2
	}
	if size > cap(x.slots) {
		x.slots = make([]replySlot[K], size)
	} else {
		x.slots = x.slots[:size]
		clear(x.slots)
	}
	x.n = 0
}

// put sets k's reply.
func (x *replyIndex[K]) put(k K, r replyInfo) {
	if 2*(x.n+1) > len(x.slots) {
		x.grow()
	}
	mask := uint64(len(x.slots) - 1)
	for i := x.hash(k) & mask; ; i = (i + 1) & mask {
		s := &x.slots[i]
		if !s.used {
			*s = replySlot[K]{key: k, info: r, used: true}
			x.n++
			return
		}
		if s.key == k {
			s.info = r
			return
		}
	}
}

// get returns k's reply, if any.
func (x *replyIndex[K]) get(k K) (replyInfo, bool) {
	mask := uint64(len(x.slots) - 1)
	for i := x.hash(k) & mask; ; i = (i + 1) & mask {
		s := &x.slots[i]
		if !s.used {
			return replyInfo{}, false
		}
		if s.key == k {
			return s.info, true
		}
	}
}

func (x *replyIndex[K]) grow() {
	old := x.slots
	x.slots, x.n = make([]replySlot[K], 2*len(old)), 0
	for i := range old {
		if old[i].used {
			x.put(old[i].key, old[i].info)
		}
	}
}

// mix64 is splitmix64's finalizer: every input bit moves every output bit,
// so the table's low bits spread keys that differ only in a port.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

func hashNATKeyV4(k NATKeyV4) uint64 {
	return mix64(uint64(k.Src)|uint64(k.Dst)<<32) ^
		mix64(uint64(k.Sport)|uint64(k.Dport)<<16|uint64(k.Proto)<<32|uint64(k.Dir)<<40|1<<63)
}

func hashNATKeyV6(k NATKeyV6) uint64 {
	le := binary.LittleEndian
	h := mix64(le.Uint64(k.Src[:8])) ^ mix64(le.Uint64(k.Src[8:])+1)
	h = mix64(h ^ le.Uint64(k.Dst[:8]))
	h = mix64(h ^ le.Uint64(k.Dst[8:]))
	return h ^ mix64(uint64(k.Sport)|uint64(k.Dport)<<16|uint64(k.Proto)<<32|uint64(k.Dir)<<40|1<<63)
}
