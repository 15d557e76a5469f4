package topology

import (
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sync"

	"golang.org/x/sys/unix"
)

// LeakWatch records the packets seen on a device whose source is inside
// one of the watched prefixes (masquerade sources: pods, tunnel clients),
// but those of the flows allowed and those from the ignored addresses: a
// packet that left a node with an address it should have been translated
// from.
type LeakWatch struct {
	mu      sync.Mutex
	leaked  []string
	sources []netip.Prefix
	ignore  []netip.Addr
	allowed []watchedFlow
	f       *os.File
	done    chan struct{}
}

// watchedFlow is a flow of a masquerade source, as the watcher sees it.
type watchedFlow struct {
	dst   netip.Addr
	proto byte
	sport uint16
}

// WatchLeaks opens a packet socket on dev in n (the network-layer view, so
// it works on Ethernet and L3 devices alike) and records every packet
// whose source is in sources and not one of ignore (e.g. a node's own
// address inside a pod range, which the kernel may pick as a source) until
// Close.
func WatchLeaks(n *Netns, dev string, ignore []netip.Addr, sources ...netip.Prefix) (*LeakWatch, error) {
	f, err := OpenPacketSocket(n, dev, unix.ETH_P_ALL)
	if err != nil {
		return nil, err
	}
	w := &LeakWatch{sources: sources, ignore: ignore, f: f, done: make(chan struct{})}
	go w.read()
	return w, nil
}

// OpenPacketSocket opens a packet socket on dev in n that reads the
// packets of ethertype proto (unix.ETH_P_ALL: every one) from their
// network header on (SOCK_DGRAM: the same view on Ethernet and L3
// devices). Reads block until a packet comes or the file is closed.
func OpenPacketSocket(n *Netns, dev string, proto uint16) (*os.File, error) {
	l, err := n.NL.LinkByName(dev)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", n.Name, err)
	}
	be := proto<<8 | proto>>8 // network byte order
	var f *os.File
	err = n.Do(func() error {
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, int(be))
		if err != nil {
			return fmt.Errorf("packet socket: %w", err)
		}
		if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: be, Ifindex: l.Attrs().Index}); err != nil {
			unix.Close(fd)
			return fmt.Errorf("bind packet socket to %s: %w", dev, err)
		}
		f = os.NewFile(uintptr(fd), "packet:"+dev)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", n.Name, err)
	}
	return f, nil
}

// Allow lets the packets of one flow (TCP or UDP) from a watched source to
// dst with source port sport reach the device with the source's address:
// a flow that is not masqueraded on purpose. Call it before the flow's
// first packet.
func (w *LeakWatch) Allow(dst netip.Addr, proto byte, sport uint16) {
	w.mu.Lock()
	w.allowed = append(w.allowed, watchedFlow{dst, proto, sport})
	w.mu.Unlock()
}

// Leaked describes the packets recorded so far, oldest first.
func (w *LeakWatch) Leaked() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.leaked)
}

// Close stops the watch.
func (w *LeakWatch) Close() {
	w.f.Close()
	<-w.done
}

func (w *LeakWatch) read() {
	defer close(w.done)
	buf := make([]byte, 65536)
	for {
		n, err := w.f.Read(buf)
		if err != nil {
			return
		}
		var src, dst netip.Addr
		var proto byte
		l4 := -1 // where the ports are: first fragments and unfragmented packets only
		switch {
		case n >= 20 && buf[0]>>4 == 4:
			src, dst, proto = netip.AddrFrom4([4]byte(buf[12:16])), netip.AddrFrom4([4]byte(buf[16:20])), buf[9]
			if buf[6]&0x1f == 0 && buf[7] == 0 {
				l4 = int(buf[0]&0xf) * 4
			}
		case n >= 40 && buf[0]>>4 == 6:
			src, dst, proto = netip.AddrFrom16([16]byte(buf[8:24])), netip.AddrFrom16([16]byte(buf[24:40])), buf[6]
			l4 = 40 // no extension headers in the tests' flows
		default:
			continue
		}
		if slices.Contains(w.ignore, src) {
			continue
		}
		var sport uint16
		if l4 >= 0 && n >= l4+4 {
			sport = uint16(buf[l4])<<8 | uint16(buf[l4+1])
		}
		for _, p := range w.sources {
			if !p.Contains(src) {
				continue
			}
			w.mu.Lock()
			if !slices.Contains(w.allowed, watchedFlow{dst, proto, sport}) || (proto != unix.IPPROTO_TCP && proto != unix.IPPROTO_UDP) {
				w.leaked = append(w.leaked, fmt.Sprintf("%s protocol %d port %d to %s, %d bytes", src, proto, sport, dst, n))
			}
			w.mu.Unlock()
		}
	}
}
