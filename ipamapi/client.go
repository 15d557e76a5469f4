package ipamapi

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"sync"
)

// maxAnswer bounds the buffer readBody sizes from a Content-Length
// header: an answer with 16 384 prefixes is ~280 KB (IPv4) to ~400 KB
// (IPv6); a larger announced size is read as it arrives.
const maxAnswer = 8 << 20

// Client talks to the agent's API over its unix socket.
type Client struct {
	socket string
	http   *http.Client
	// bodies holds answer buffers (*[]byte) for reuse: with 16 384
	// prefixes an answer is ~280 KB, garbage after its decode (the decoded
	// values hold no reference to it). A long-lived client that allocates
	// often (a test, a benchmark, any program calling the API in a loop)
	// made the collector run every few answers, and a collection during
	// an answer was most of the p99 with 16 384 prefixes.
	bodies sync.Pool
}

// NewClient returns a client for the API at socket.
func NewClient(socket string) *Client {
	return &Client{
		socket: socket,
		http: &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", socket)
			},
		}},
	}
}

// Error is an error answer of the API.
type Error struct {
	Status  int
	Message string
}

func (e *Error) Error() string { return fmt.Sprintf("ipmasq API: %s (HTTP %d)", e.Message, e.Status) }

// Allocate asks for the owner's address of a family ("ipv4" or "ipv6").
func (c *Client) Allocate(ctx context.Context, req AllocationRequest) (AllocationResponse, error) {
	var out allocationWire
	body, _ := json.Marshal(req)
	err := c.do(ctx, http.MethodPost, "/v1/ipam/allocations", body, func(b []byte) error { return decodeAllocation(b, &out) })
	out.AllocationResponse.NonMasqueradeCIDRs = out.NonMasqueradeCIDRs
	return out.AllocationResponse, err
}

// List returns every allocation.
func (c *Client) List(ctx context.Context) ([]AllocationResponse, error) {
	var out ListResponse
	err := c.do(ctx, http.MethodGet, "/v1/ipam/allocations", nil, func(b []byte) error {
		return json.NewDecoder(bytes.NewReader(b)).Decode(&out)
	})
	return out.Allocations, err
}

// Release frees an address.
func (c *Client) Release(ctx context.Context, ip netip.Addr) error {
	return c.do(ctx, http.MethodDelete, "/v1/ipam/allocations/"+ip.String(), nil, nil)
}

// ReleaseOwner frees every address of an owner.
func (c *Client) ReleaseOwner(ctx context.Context, owner string) error {
	return c.do(ctx, http.MethodDelete, "/v1/ipam/allocations?owner="+url.QueryEscape(owner), nil, nil)
}

// do sends a request and hands a successful answer's body, read whole, to
// decode (nil: the body is not read).
func (c *Client) do(ctx context.Context, method, path string, body []byte, decode func([]byte) error) error {
	req, err := http.NewRequestWithContext(ctx, method, "http://ipmasq"+path, bytes.NewReader(body))
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("ipmasq API at %s: %w (is the agent running?)", c.socket, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		var e ErrorResponse
		if json.NewDecoder(resp.Body).Decode(&e) != nil || e.Error == "" {
			e.Error = resp.Status
		}
		return &Error{Status: resp.StatusCode, Message: e.Error}
	}
	if decode == nil || resp.StatusCode == http.StatusNoContent {
		return nil
	}
	buf, _ := c.bodies.Get().(*[]byte)
	if buf == nil {
		buf = new([]byte)
	}
	data, err := readBody(resp, *buf)
	if err != nil {
		return fmt.Errorf("ipmasq API at %s: read answer: %w", c.socket, err)
	}
	err = decode(data)
	// A list of many allocations can be far larger than an allocation;
	// such a buffer is not kept.
	if cap(data) <= maxAnswer {
		*buf = data[:0]
		c.bodies.Put(buf)
	}
	return err
}

// readBody reads a whole answer body into buf, grown to its announced
// size when it has one (the agent announces it) instead of growing and
// copying as it goes.
func readBody(resp *http.Response, buf []byte) ([]byte, error) {
	if n := resp.ContentLength; n >= 0 && n <= maxAnswer {
		if int64(cap(buf)) < n {
			buf = make([]byte, n)
		}
		b := buf[:n]
		if _, err := io.ReadFull(resp.Body, b); err != nil {
			return nil, err
		}
		return b, nil
	}
	w := bytes.NewBuffer(buf[:0])
	_, err := w.ReadFrom(resp.Body)
	return w.Bytes(), err
}
