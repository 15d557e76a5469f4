package api

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
)

// Client talks to the agent's API over its unix socket.
type Client struct {
	socket string
	http   *http.Client
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
	err := c.do(ctx, http.MethodPost, "/v1/ipam/allocations", body, &out)
	out.AllocationResponse.NonMasqueradeCIDRs = out.NonMasqueradeCIDRs
	return out.AllocationResponse, err
}

// List returns every allocation.
func (c *Client) List(ctx context.Context) ([]AllocationResponse, error) {
	var out ListResponse
	err := c.do(ctx, http.MethodGet, "/v1/ipam/allocations", nil, &out)
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

func (c *Client) do(ctx context.Context, method, path string, body []byte, out any) error {
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
	if out == nil || resp.StatusCode == http.StatusNoContent {
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}
