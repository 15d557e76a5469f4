package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// Action is what a program did with a packet (enum action in
// lib/counters.h). Every packet a program sees ends in exactly one action,
// so the actions of a device sum to every packet its programs saw.
type Action uint32

// Actions.
const (
	ActionPassed     = Action(masqActionACTION_PASSED)
	ActionTranslated = Action(masqActionACTION_TRANSLATED)
	ActionDropped    = Action(masqActionACTION_DROPPED)
	// NumActions is the number of actions.
	NumActions = Action(masqActionACTION_MAX)
)

var actionNames = [NumActions]string{ActionPassed: "passed", ActionTranslated: "translated", ActionDropped: "dropped"}

func (a Action) String() string {
	if a < NumActions {
		return actionNames[a]
	}
	return fmt.Sprintf("action-%d", uint32(a))
}

// DropReason is why a packet was dropped (enum drop_reason).
type DropReason uint32

// Drop reasons; each names the global Counter that counts it too.
const (
	DropOther              = DropReason(masqDropReasonDROP_OTHER)
	DropUntranslatable     = DropReason(masqDropReasonDROP_UNTRANSLATABLE)
	DropNATFull            = DropReason(masqDropReasonDROP_NAT_FULL)
	DropNoPort             = DropReason(masqDropReasonDROP_NO_PORT)
	DropFragmentUnknown    = DropReason(masqDropReasonDROP_FRAG_UNKNOWN)
	DropNoSNATAddress      = DropReason(masqDropReasonDROP_NO_SNAT_ADDR)
	DropICMPErrorUnmatched = DropReason(masqDropReasonDROP_ICMP_ERR_UNMATCHED)
	DropPairTaken          = DropReason(masqDropReasonDROP_PAIR_TAKEN)
	DropError              = DropReason(masqDropReasonDROP_ERROR)
	DropNoPair             = DropReason(masqDropReasonDROP_NO_PAIR)
	DropPairClaimed        = DropReason(masqDropReasonDROP_PAIR_CLAIMED)
	DropHandback           = DropReason(masqDropReasonDROP_HANDBACK)
	// NumDropReasons is the number of reasons.
	NumDropReasons = DropReason(masqDropReasonDROP_REASON_MAX)
)

var dropReasonNames = [NumDropReasons]string{
	DropOther:              "other",
	DropUntranslatable:     "untranslatable",
	DropNATFull:            "nat-table-full",
	DropNoPort:             "no-free-port",
	DropFragmentUnknown:    "fragment-unknown",
	DropNoSNATAddress:      "no-snat-address",
	DropICMPErrorUnmatched: "icmp-error-unmatched",
	DropPairTaken:          "pair-taken",
	DropError:              "error",
	DropNoPair:             "no-pair",
	DropPairClaimed:        "pair-claimed",
	DropHandback:           "handback",
}

func (r DropReason) String() string {
	if r < NumDropReasons {
		return dropReasonNames[r]
	}
	return fmt.Sprintf("reason-%d", uint32(r))
}

// DevCounters are one device's counters for one family and direction,
// summed over CPUs.
type DevCounters struct {
	Ifindex uint32
	// Family is "ipv4", "ipv6" or "other" (ARP and the rest, which pass).
	Family string
	// Direction is "egress" or "ingress".
	Direction string
	Packets   [NumActions]uint64
	Drops     [NumDropReasons]uint64
}

var counterFamilies = map[uint8]string{
	uint8(masqCounterFamilyFAMILY_IPV4): "ipv4", uint8(masqCounterFamilyFAMILY_IPV6): "ipv6",
	uint8(masqCounterFamilyFAMILY_OTHER): "other",
}

// ReadDevCounters reads dev_counters (Datapath.Maps.DevCounters or the pin):
// in batches (a scrape reads it, one syscall for a few devices where an
// iteration costs two per entry), entry by entry on a kernel without batch
// reads.
func ReadDevCounters(m *ebpf.Map) ([]DevCounters, error) {
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, err
	}
	// A batch read of a hash map takes whole buckets: ENOSPC says a bucket
	// holds more than the batch, and the read starts again with a larger
	// one.
	for chunk := 64; ; chunk *= 2 {
		out, err := readDevCounterBatches(m, chunk, cpus)
		switch {
		case errors.Is(err, unix.ENOSPC) && chunk < int(m.MaxEntries()):
			continue
		case errors.Is(err, ebpf.ErrNotSupported):
			return readDevCountersByKey(m)
		case err != nil:
			return nil, fmt.Errorf("read %s: %w", MapDevCounters, err)
		}
		return out, nil
	}
}

func readDevCounterBatches(m *ebpf.Map, chunk, cpus int) ([]DevCounters, error) {
	var (
		out    []DevCounters
		cursor ebpf.MapBatchCursor
		keys   = make([]masqDevCounterKey, chunk)
		vals   = make([]masqDevCounterVal, chunk*cpus)
	)
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil, err
		}
		for i := range n {
			out = append(out, devCountersOf(keys[i], vals[i*cpus:(i+1)*cpus]))
		}
		if err != nil {
			return out, nil // ErrKeyNotExist: the end
		}
	}
}

// readDevCountersByKey is ReadDevCounters one entry at a time.
func readDevCountersByKey(m *ebpf.Map) ([]DevCounters, error) {
	var (
		out    []DevCounters
		k      masqDevCounterKey
		perCPU []masqDevCounterVal
	)
	it := m.Iterate()
	for it.Next(&k, &perCPU) {
		out = append(out, devCountersOf(k, perCPU))
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", MapDevCounters, err)
	}
	return out, nil
}

// devCountersOf is one entry's counters, summed over CPUs.
func devCountersOf(k masqDevCounterKey, perCPU []masqDevCounterVal) DevCounters {
	d := DevCounters{Ifindex: k.Ifindex, Family: counterFamilies[k.Family], Direction: "egress"}
	if d.Family == "" {
		d.Family = fmt.Sprintf("family-%d", k.Family)
	}
	if k.Dir == DirIngress {
		d.Direction = "ingress"
	}
	for _, v := range perCPU {
		for a := range d.Packets {
			d.Packets[a] += v.Packets[a]
		}
		for r := range d.Drops {
			d.Drops[r] += v.Drops[r]
		}
	}
	return d
}

// DevCounters returns the per-device counters from the pin.
func (p Pinned) DevCounters() ([]DevCounters, error) {
	m, err := p.open(MapDevCounters)
	if err != nil {
		return nil, err
	}
	defer p.release(m)
	return ReadDevCounters(m)
}

// ForgetDevCounters deletes dev_counters' entries of the devices for which
// keep returns false: the tc attachment's owner calls it when it detaches
// from a device, so that a device that is gone (or no longer selected)
// leaves the metrics instead of lingering there as ifindex-N, and a new
// device that gets its index later starts from zero.
func ForgetDevCounters(m *ebpf.Map, keep func(ifindex uint32) bool) error {
	var (
		k     masqDevCounterKey
		stale []masqDevCounterKey
	)
	// Keys only: the values (per-CPU arrays) are not needed to decide.
	it := m.Iterate()
	var perCPU []masqDevCounterVal
	for it.Next(&k, &perCPU) {
		if !keep(k.Ifindex) {
			stale = append(stale, k)
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("read %s: %w", MapDevCounters, err)
	}
	var errs []error
	for _, k := range stale {
		if err := m.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("delete %s entry of ifindex %d: %w", MapDevCounters, k.Ifindex, err))
		}
	}
	return errors.Join(errs...)
}
