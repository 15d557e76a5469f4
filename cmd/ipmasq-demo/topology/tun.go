package topology

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"unsafe"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// TunLink connects two namespaces with a point-to-point L3 link made of two
// tun devices (IFF_TUN|IFF_NO_PI: no link-layer header, like WireGuard,
// ipip or ppp) and goroutines that copy every packet one device sends to
// the other: aName in a, bName in b, both up, MTU 1500. Closing the result
// stops the copying and removes both devices.
func TunLink(a *Netns, aName string, b *Netns, bName string) (*Tun, error) {
	fa, err := openTun(a, aName)
	if err != nil {
		return nil, err
	}
	fb, err := openTun(b, bName)
	if err != nil {
		fa.Close()
		return nil, err
	}
	t := &Tun{a: fa, b: fb}
	t.wg.Add(2)
	go t.copy(fa, fb)
	go t.copy(fb, fa)
	for _, end := range []struct {
		n    *Netns
		name string
	}{{a, aName}, {b, bName}} {
		if err := end.n.setUp(end.name); err != nil {
			t.Close()
			return nil, err
		}
	}
	return t, nil
}

// Tun is a running TunLink.
type Tun struct {
	a, b *os.File
	wg   sync.WaitGroup
}

// Close stops the forwarder; the devices go with their file descriptors.
func (t *Tun) Close() error {
	err := errors.Join(t.a.Close(), t.b.Close())
	t.wg.Wait()
	return err
}

func (t *Tun) copy(from, to *os.File) {
	defer t.wg.Done()
	buf := make([]byte, 65536)
	for {
		n, err := from.Read(buf)
		if err != nil {
			return // closed
		}
		// A packet the other side cannot take (it is going away) is lost,
		// as on a wire.
		to.Write(buf[:n])
	}
}

// OpenTun creates a tun device (IFF_TUN|IFF_NO_PI) in n, down, without
// addresses; it lives as long as the returned file is open. Nothing reads
// it: packets sent through it are lost, which is enough for a device that
// only has to exist (and have carrier).
func OpenTun(n *Netns, name string) (*os.File, error) {
	return openTun(n, name)
}

// openTun creates a tun device in n. The file descriptor is non-blocking so
// that the runtime poller serves it and Close interrupts a pending Read.
func openTun(n *Netns, name string) (*os.File, error) {
	var f *os.File
	err := n.Do(func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
		if err != nil {
			return fmt.Errorf("open /dev/net/tun: %w", err)
		}
		var req struct {
			name  [unix.IFNAMSIZ]byte
			flags uint16
			_     [22]byte
		}
		copy(req.name[:], name)
		req.flags = unix.IFF_TUN | unix.IFF_NO_PI
		if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TUNSETIFF, uintptr(unsafe.Pointer(&req))); errno != 0 {
			unix.Close(fd)
			return fmt.Errorf("TUNSETIFF %s: %w", name, errno)
		}
		f = os.NewFile(uintptr(fd), "tun:"+name)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("%s: tun device %s: %w", n.Name, name, err)
	}
	return f, nil
}

// WireGuardAvailable reports whether the kernel can create a WireGuard
// device, by creating one in n and removing it again.
func WireGuardAvailable(n *Netns) error {
	wg := &netlink.Wireguard{LinkAttrs: netlink.LinkAttrs{Name: "wgprobe0"}}
	if err := n.NL.LinkAdd(wg); err != nil {
		return err
	}
	return n.NL.LinkDel(wg)
}
