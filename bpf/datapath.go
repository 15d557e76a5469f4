// Package bpf is the masquerade datapath: the tc programs ipmasq_egress and
// ipmasq_ingress (masq.c and lib/*.h, compiled by bpf2go into the committed
// masq_bpfel.go/.o) and the maps they share with the agent.
//
// The agent loads the datapath with [Load], attaches [Datapath.Egress] and
// [Datapath.Ingress] with tcx on each selected Ethernet egress device (the
// L3 variants, [Datapath.ProgramsL3], on devices without a link-layer
// header), and fills the
// maps: masquerade sources (masq_src_*), user masquerade rules for other
// sources per egress device (masq_rules_*), node addresses (node_addrs_*),
// the SNAT address per device (egress_devs) and the NAT port range (config).
// Load creates or reopens every map, the nonmasq_* tries included (their
// contents are written by reconcilers/nonmasqmaps through the loaded
// Datapath); readers open them read-only through [Pinned].
//
// NAT state (nat_v4, nat_v6) holds both directions of each translated flow:
// dir 0 maps the pod's tuple to {SNAT address, NAT port}, dir 1 maps the
// reply tuple back to {pod address, pod port}. The programs create and
// refresh entries (last_seen_ns, TCP FIN/RST flags); removing idle pairs is
// the job of a collector in the agent, which must keep closed TCP pairs for
// a TIME_WAIT period so that a NAT port is not handed to a new flow to the
// same server too soon.
package bpf

import (
	"cmp"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/bpfmap"
)

// DefaultNATMaxEntries is the size of nat_v4 and nat_v6 when
// LoadOptions.NATMaxEntries is 0: entries, so half as many flows (each flow
// takes one entry per direction). The agent sizes the maps from the node
// instead (--nat-max-entries, reconcilers/datapath).
const DefaultNATMaxEntries = 131072

// UnmasqEntries is the size of unmasq_v4 and unmasq_v6 for NAT maps of
// natMaxEntries: a quarter, so half as many flows as the NAT map holds
// pairs. The records are an LRU whose loss only means a flow is decided
// again (lib/unmasq.h): they need not hold every unmasqueraded flow, only
// those running when the config changes, and cost 96 (IPv4) and 120 (IPv6)
// bytes of kernel memory each (bpftool's memlock, preallocated).
func UnmasqEntries(natMaxEntries uint32) uint32 {
	return max(natMaxEntries/4, 1024)
}

// Map names: the pins under the agent's pin directory. They are the names
// lib/maps.h gives the maps, as bpf2go generated them: declared once, in C.
const (
	MapNonMasqV4   = masqMapNonmasqV4
	MapNonMasqV6   = masqMapNonmasqV6
	MapMasqSrcV4   = masqMapMasqSrcV4
	MapMasqSrcV6   = masqMapMasqSrcV6
	MapMasqRulesV4 = masqMapMasqRulesV4
	MapMasqRulesV6 = masqMapMasqRulesV6
	MapNodeAddrsV4 = masqMapNodeAddrsV4
	MapNodeAddrsV6 = masqMapNodeAddrsV6
	MapEgressDevs  = masqMapEgressDevs
	MapConfig      = masqMapConfig
	MapNATV4       = masqMapNatV4
	MapNATV6       = masqMapNatV6
	MapUnmasqV4    = masqMapUnmasqV4
	MapUnmasqV6    = masqMapUnmasqV6
	MapFragV4      = masqMapFragV4
	MapFragV6      = masqMapFragV6
	MapCounters    = masqMapCounters
	MapDevCounters = masqMapDevCounters
)

// Maps are the datapath's maps, named like their pins.
type Maps = masqMaps

// CompatMaps are the compat build's maps (variant.go): Maps and the lock
// of its atomics.
type CompatMaps = masqcompatMaps

// Programs are the object's programs (bpf/masq.c), named like its SEC
// functions.
type Programs = masqPrograms

// Datapath is the loaded masquerade datapath.
type Datapath struct {
	// Egress is ipmasq_egress, for tcx egress of each egress device.
	Egress *ebpf.Program
	// Ingress is ipmasq_ingress, for tcx ingress of the same devices.
	Ingress *ebpf.Program
	// Maps are the maps the programs use.
	Maps Maps
	// Variant is the build of the object loaded, and VariantReason why
	// (LoadOptions.Variant, [ChooseVariant]).
	Variant       Variant
	VariantReason string

	objs masqObjects
	// coll holds what Load loaded (objs' programs and maps, and the
	// global variables' maps), for the L3 programs' later load.
	coll *ebpf.Collection
	// l3 loads the L3 programs once, at the first call of ProgramsL3.
	l3 struct {
		sync.Mutex
		spec            *ebpf.CollectionSpec
		opts            ebpf.ProgramOptions
		egress, ingress *ebpf.Program
	}
}

// l3Programs are the programs for devices without a link-layer header:
// loaded when the first such device is attached (ProgramsL3), as most
// nodes have none, and each load costs the verifier as much as its
// Ethernet twin's (the longest part of a start on an old kernel).
var l3Programs = []string{"ipmasq_egress_l3", "ipmasq_ingress_l3"}

// ProgramsL3 returns ipmasq_egress_l3 and ipmasq_ingress_l3, the programs
// for devices without a link-layer header (tun, WireGuard, ipip, ...),
// whose packets start at the network header. They are loaded at the first
// call, with the maps of the loaded datapath; an error is returned again
// at the next call's retry.
func (d *Datapath) ProgramsL3() (egress, ingress *ebpf.Program, err error) {
	d.l3.Lock()
	defer d.l3.Unlock()
	if d.l3.egress != nil {
		return d.l3.egress, d.l3.ingress, nil
	}
	if d.l3.spec == nil || d.coll == nil {
		return nil, nil, errors.New("the datapath's L3 programs: not loaded by bpf.Load")
	}
	spec := d.l3.spec.Copy()
	for name := range spec.Programs {
		if !slices.Contains(l3Programs, name) {
			delete(spec.Programs, name)
		}
	}
	// Every map is the loaded datapath's (the global variables' too).
	replacements := map[string]*ebpf.Map{}
	for name := range spec.Maps {
		m, ok := d.coll.Maps[name]
		if !ok {
			return nil, nil, fmt.Errorf("the datapath's L3 programs: map %s not loaded", name)
		}
		replacements[name] = m
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: replacements, Programs: d.l3.opts})
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, nil, fmt.Errorf("load the datapath's L3 programs (%s variant): %+v", d.Variant, ve)
		}
		return nil, nil, fmt.Errorf("load the datapath's L3 programs (%s variant): %w", d.Variant, err)
	}
	d.l3.egress = coll.DetachProgram(l3Programs[0])
	d.l3.ingress = coll.DetachProgram(l3Programs[1])
	coll.Close()
	return d.l3.egress, d.l3.ingress, nil
}

// LoadOptions configure [Load].
type LoadOptions struct {
	// PinDir is the directory (on a BPF filesystem) where every map except
	// the nonmasq tries is pinned by name and reused across restarts; a
	// pinned map with an incompatible layout is replaced. Empty: nothing
	// is pinned (tests).
	PinDir string
	// NonMasqMaxEntries sizes the nonmasq tries nonmasq_v4 and nonmasq_v6
	// (--max-nonmasq-cidrs); 0 keeps lib/maps.h's size. The loader is
	// their one owner: it creates or reopens them with the other maps, and
	// reconcilers/nonmasqmaps writes them through the loaded Datapath.
	NonMasqMaxEntries uint32
	// NATMaxEntries sizes nat_v4 and nat_v6, and through UnmasqEntries
	// unmasq_v4 and unmasq_v6; 0 means DefaultNATMaxEntries.
	NATMaxEntries uint32
	// NATMaxEntriesV4 and NATMaxEntriesV6, when not 0, size one family's
	// map instead (e.g. a small one for a disabled family), and its
	// unmasq map with it.
	NATMaxEntriesV4, NATMaxEntriesV6 uint32
	// Logger receives map replacement warnings; nil means slog.Default().
	Logger *slog.Logger
	// Variant is the object to load (--datapath-variant): auto (or empty)
	// probes the kernel ([ProbeKernel], [ChooseVariant]).
	Variant Variant

	// natMapKind, in tests, changes the NAT maps' kind before they are
	// made (the measurements of docs/datapath.md "Map kinds").
	natMapKind func(*ebpf.MapSpec)
	// programs, in tests, are the programs' load options (the verifier's
	// statistics of TestVerifierComplexity).
	programs ebpf.ProgramOptions
}

// Load loads the programs and their maps into the kernel. The programs are
// not attached.
func Load(opts LoadOptions) (*Datapath, error) {
	want := opts.Variant
	if want == "" && testVariant != "" {
		want = testVariant
	}
	choice, err := ChooseVariant(want, ProbeKernel())
	if err != nil {
		return nil, err
	}
	spec, err := choice.Variant.spec()
	if err != nil {
		return nil, fmt.Errorf("load ipmasq datapath spec: %w", err)
	}
	if opts.NATMaxEntries == 0 {
		opts.NATMaxEntries = DefaultNATMaxEntries
	}
	spec.Maps[MapNATV4].MaxEntries = cmp.Or(opts.NATMaxEntriesV4, opts.NATMaxEntries)
	spec.Maps[MapNATV6].MaxEntries = cmp.Or(opts.NATMaxEntriesV6, opts.NATMaxEntries)
	spec.Maps[MapUnmasqV4].MaxEntries = UnmasqEntries(spec.Maps[MapNATV4].MaxEntries)
	spec.Maps[MapUnmasqV6].MaxEntries = UnmasqEntries(spec.Maps[MapNATV6].MaxEntries)
	if err := sizeNotes(spec); err != nil {
		return nil, err
	}
	if opts.PinDir != "" {
		if err := keepNoteSeed(spec, opts.Logger, opts.PinDir); err != nil {
			return nil, err
		}
	}
	if opts.natMapKind != nil {
		opts.natMapKind(spec.Maps[MapNATV4])
		opts.natMapKind(spec.Maps[MapNATV6])
	}

	if !csumIPv6FlagSupported() {
		if err := spec.Variables["csum_ipv6_flag"].Set(uint64(0)); err != nil {
			return nil, fmt.Errorf("clear csum_ipv6_flag: %w", err)
		}
	}
	if err := setCompatClock(choice.Variant, spec); err != nil {
		return nil, err
	}
	// The ingress program asks conntrack about pairs handed over only
	// where the kernel has the lookup (lib/handover.h).
	if ok, _ := ConntrackLookupAvailable(); ok {
		if err := spec.Variables["conntrack_lookup"].Set(uint32(1)); err != nil {
			return nil, fmt.Errorf("set conntrack_lookup: %w", err)
		}
	}

	replacements := map[string]*ebpf.Map{}
	defer func() {
		// The collection holds clones.
		for _, m := range replacements {
			m.Close()
		}
	}()
	if opts.NonMasqMaxEntries != 0 {
		spec.Maps[MapNonMasqV4].MaxEntries = opts.NonMasqMaxEntries
		spec.Maps[MapNonMasqV6].MaxEntries = opts.NonMasqMaxEntries
	}
	var pinnedBefore map[string]ebpf.MapID
	if opts.PinDir != "" {
		pinnedBefore = pinnedIDs(opts.PinDir, MapNATCount, MapNATV4, MapNATV6)
		for _, name := range pinnedMaps(spec) {
			open := bpfmap.OpenPinned
			switch name {
			case MapNATV4, MapNATV6, MapUnmasqV4, MapUnmasqV6, MapNonMasqV4, MapNonMasqV6:
				// A resized NAT map keeps its pairs: established flows
				// survive a changed --nat-max-entries; so do the
				// decisions of unmasqueraded flows, and a resized
				// nonmasq trie (--max-nonmasq-cidrs) keeps the config
				// in force until its reconciler has written it: the new
				// programs never see an empty trie.
				open = bpfmap.OpenPinnedKeep
			}
			m, err := open(opts.Logger, opts.PinDir, spec.Maps[name])
			if err != nil {
				return nil, err
			}
			replacements[name] = m
		}
	}

	d := &Datapath{Variant: choice.Variant, VariantReason: choice.Reason}
	d.l3.spec, d.l3.opts = spec.Copy(), opts.programs
	for _, name := range l3Programs {
		delete(spec.Programs, name)
	}
	d.coll, err = ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: replacements, Programs: opts.programs})
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("load ipmasq datapath (%s variant): %+v", choice.Variant, ve)
		}
		return nil, fmt.Errorf("load ipmasq datapath (%s variant): %w", choice.Variant, err)
	}
	if err := assignLoaded(d.coll, &d.objs); err != nil {
		d.coll.Close()
		return nil, err
	}
	d.Egress = d.objs.IpmasqEgress
	d.Ingress = d.objs.IpmasqIngress
	d.Maps = d.objs.masqMaps
	if opts.PinDir != "" {
		if err := recountNAT(d, pinnedBefore); err != nil {
			d.Close()
			return nil, err
		}
		removeRetiredPins(opts.Logger, opts.PinDir)
		// No hand-back is under way at a load: notes in the pinned maps
		// are an earlier agent's, stopped during one (the programs would
		// drop the replies of a flow whose conntrack entry never came).
		if err := d.ClearHandBacks(); err != nil {
			d.Close()
			return nil, err
		}
	}
	return d, nil
}

// NoteSlots is the size of early drop's notes (nat_cand_v4/v6, lib/evict.h)
// for a NAT map of natMaxEntries: a slot per pair the map holds, at least
// 16 (early drop's search reads a table of up to 32 slots whole).
func NoteSlots(natMaxEntries uint32) uint32 {
	return max(natMaxEntries/2, 16)
}

// sizeNotes sizes the notes to the NAT maps and draws their hash's seed
// (so that no remote can aim its flows' notes at a few slots).
func sizeNotes(spec *ebpf.CollectionSpec) error {
	var seed [4]byte
	if _, err := rand.Read(seed[:]); err != nil {
		return fmt.Errorf("early drop's seed: %w", err)
	}
	for _, f := range []struct{ nat, notes, slots string }{
		{MapNATV4, masqMapNatCandV4, "nat_note_slots_v4"},
		{MapNATV6, masqMapNatCandV6, "nat_note_slots_v6"},
	} {
		n := NoteSlots(spec.Maps[f.nat].MaxEntries)
		spec.Maps[f.notes].MaxEntries = n
		if err := spec.Variables[f.slots].Set(n); err != nil {
			return fmt.Errorf("set %s: %w", f.slots, err)
		}
	}
	if err := spec.Variables["nat_note_seed"].Set(binary.LittleEndian.Uint32(seed[:])); err != nil {
		return fmt.Errorf("set nat_note_seed: %w", err)
	}
	return nil
}

// MapNoteSeed is the pinned map (one 32-bit value) that keeps the seed
// of early drop's notes' hash across loads.
const MapNoteSeed = "nat_note_seed"

// LoaderMaps are the maps Load pins beside the programs' own.
var LoaderMaps = []string{MapNoteSeed}

// keepNoteSeed gives the notes' hash the seed pinned in pinDir by an
// earlier load, or pins the one sizeNotes drew. The notes are pinned: with
// a new seed, the notes an earlier agent wrote would not lie at their
// keys' new probes, so no answer would find and arm them, and every
// search at a full table would look each one up until searches had armed
// them all. The seed is no less secret for being kept: it never
// leaves the node's kernel and the pin directory, readable by root alone.
func keepNoteSeed(spec *ebpf.CollectionSpec, logger *slog.Logger, pinDir string) error {
	m, err := bpfmap.OpenPinned(logger, pinDir, &ebpf.MapSpec{Name: MapNoteSeed, Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		return fmt.Errorf("early drop's seed: %w", err)
	}
	defer m.Close()
	var seed uint32
	if err := m.Lookup(uint32(0), &seed); err != nil {
		return fmt.Errorf("read %s: %w", MapNoteSeed, err)
	}
	if seed != 0 {
		return spec.Variables["nat_note_seed"].Set(seed)
	}
	// The first load here: keep the drawn seed (0 stands for none, so a
	// drawn 0 becomes 1).
	if err := spec.Variables["nat_note_seed"].Get(&seed); err != nil {
		return fmt.Errorf("get nat_note_seed: %w", err)
	}
	seed = max(seed, 1)
	if err := m.Put(uint32(0), seed); err != nil {
		return fmt.Errorf("write %s: %w", MapNoteSeed, err)
	}
	return spec.Variables["nat_note_seed"].Set(seed)
}

// retiredPins are maps earlier versions pinned and no program uses any
// more. Nothing but the loader would remove them (the uninstall removes the
// whole directory), so an upgraded node would keep their kernel memory.
var retiredPins = []string{
	"nat_full_until", // early drop's backoff, before its candidate notes
	"nat_drop",       // early drop's ring and its walker, before the notes by hash
}

// removeRetiredPins unpins the retired maps found in pinDir, once the new
// programs are loaded (a failed upgrade leaves them to the version that
// still uses them).
func removeRetiredPins(logger *slog.Logger, pinDir string) {
	logger = cmp.Or(logger, slog.Default())
	for _, name := range retiredPins {
		path := filepath.Join(pinDir, name)
		err := os.Remove(path)
		switch {
		case err == nil:
			logger.Info("Removed the pin of a map no longer used", "pin", path)
		case !errors.Is(err, os.ErrNotExist):
			logger.Warn("Cannot remove the pin of a map no longer used", "pin", path, "error", err)
		}
	}
}

// pinnedMaps are the maps [Load] pins, sorted: every map of spec but the
// sections of global variables (.rodata and the like, named with a dot),
// which the programs hold and the loader sets. A map added in C is pinned
// without a change here.
func pinnedMaps(spec *ebpf.CollectionSpec) []string {
	var names []string
	for name := range spec.Maps {
		if strings.HasPrefix(name, ".") {
			continue
		}
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

// assignLoaded points objs' fields (tagged `ebpf:"name"`, as bpf2go
// writes them) at coll's programs and maps of those names; the L3
// programs' stay nil (ProgramsL3). coll keeps owning them.
func assignLoaded(coll *ebpf.Collection, objs *masqObjects) error {
	for _, group := range []reflect.Value{reflect.ValueOf(&objs.masqPrograms).Elem(), reflect.ValueOf(&objs.masqMaps).Elem()} {
		for i := range group.NumField() {
			name := group.Type().Field(i).Tag.Get("ebpf")
			var v reflect.Value
			if p, ok := coll.Programs[name]; ok {
				v = reflect.ValueOf(p)
			} else if m, ok := coll.Maps[name]; ok {
				v = reflect.ValueOf(m)
			} else if slices.Contains(l3Programs, name) {
				continue
			} else {
				return fmt.Errorf("load ipmasq datapath: %s not in the object", name)
			}
			group.Field(i).Set(v)
		}
	}
	return nil
}

// Close releases the programs and maps; pins and attachments stay.
func (d *Datapath) Close() error {
	d.l3.Lock()
	for _, p := range []*ebpf.Program{d.l3.egress, d.l3.ingress} {
		if p != nil {
			p.Close()
		}
	}
	d.l3.egress, d.l3.ingress = nil, nil
	d.l3.Unlock()
	if d.coll != nil {
		d.coll.Close()
		return nil
	}
	return d.objs.Close()
}
