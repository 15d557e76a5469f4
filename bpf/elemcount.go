package bpf

import (
	"encoding/binary"
	"fmt"
	"io"
	"runtime"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// elemCounter is the bpf_map iterator of mapcount.c, loaded once per
// process on first use.
var elemCounter struct {
	once sync.Once
	objs mapcountObjects
	link *link.Iter
	err  error
	mu   sync.Mutex // one session at a time
	// buf holds a session's output (16 bytes a map of the system), kept
	// for the next.
	buf []byte
}

// ElemCounts returns the kernel's count of the elements of each map of
// ids (map->elem_count, kept by every kind of hash map on each insert,
// delete and LRU eviction, summed over CPUs by bpf_map_sum_elem_count):
// one pass over the system's maps, whatever they hold. A map the kernel
// does not count (not a hash map) reads 0.
func ElemCounts(ids ...ebpf.MapID) (map[ebpf.MapID]int, error) {
	c := &elemCounter
	c.once.Do(func() {
		if c.err = loadMapcountObjects(&c.objs, nil); c.err != nil {
			c.err = fmt.Errorf("load the map element counter (mapcount.c, kernel 6.6 or later): %w", c.err)
			return
		}
		c.link, c.err = link.AttachIter(link.IterOptions{Program: c.objs.MapElemCounts})
		if c.err != nil {
			c.err = fmt.Errorf("attach the map element counter: %w", c.err)
		}
	})
	if c.err != nil {
		return nil, c.err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	r, err := c.link.Open()
	if err != nil {
		return nil, fmt.Errorf("read the map element counter: %w", err)
	}
	defer r.Close()
	buf := c.buf[:0]
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, make([]byte, max(32<<10, cap(buf)))...)[:len(buf)]
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("read the map element counter: %w", err)
		}
	}
	c.buf = buf
	want := map[ebpf.MapID]bool{}
	for _, id := range ids {
		want[id] = true
	}
	out := map[ebpf.MapID]int{}
	for i := 0; i+16 <= len(buf); i += 16 {
		id := ebpf.MapID(binary.LittleEndian.Uint64(buf[i:]))
		if want[id] {
			out[id] = int(int64(binary.LittleEndian.Uint64(buf[i+8:])))
		}
	}
	return out, nil
}

// mapID is m's ID, read with BPF_OBJ_GET_INFO_BY_FD alone: ebpf.Map.Info
// reads /proc/self/fdinfo as well (three more syscalls), and a scrape asks
// for the IDs of the unmasq maps every time.
func mapID(m *ebpf.Map) (ebpf.MapID, error) {
	// The head of struct bpf_map_info: the kernel fills as much of it as
	// info_len asks for. The attribute's info is a 64-bit pointer: the
	// agent is built for amd64 and arm64 only.
	var info struct{ Type, ID uint32 }
	attr := struct {
		FD, InfoLen uint32
		Info        unsafe.Pointer
	}{uint32(m.FD()), uint32(unsafe.Sizeof(info)), unsafe.Pointer(&info)}
	_, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_OBJ_GET_INFO_BY_FD, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
	runtime.KeepAlive(m)
	if errno != 0 {
		return 0, fmt.Errorf("%s: map info: %w", m, errno)
	}
	if info.ID == 0 {
		return 0, fmt.Errorf("%s: the kernel gives no map ID", m)
	}
	return ebpf.MapID(info.ID), nil
}
