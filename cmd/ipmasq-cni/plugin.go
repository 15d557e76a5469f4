package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ipmasq/ipmasq/ipamapi"
)

// timeout bounds one plugin command. An allocation may wait for the
// agent's first config load (--ipam-config-wait, 10s by default).
const timeout = 30 * time.Second

// gateway6 is the IPv6 gateway of every endpoint: link-local, so always
// reachable on the container's link and never a pod's address.
var gateway6 = net.ParseIP("fe80::1")

// call is what every command starts from: the network config, a client of
// the agent and a context bounded by timeout; for commands about one
// attachment also its owner.
type call struct {
	conf   *netConf
	client *ipamapi.Client
	ctx    context.Context
	owner  string
}

// begin parses the config (and, for one attachment, checks the container ID
// and interface name). The caller must call the returned cancel.
func begin(args *skel.CmdArgs, attachment bool) (*call, context.CancelFunc, error) {
	conf, err := parseConfig(args.StdinData)
	if err != nil {
		return nil, nil, err
	}
	c := &call{conf: conf, client: ipamapi.NewClient(conf.IPAM.SocketPath)}
	if attachment {
		if err := checkArgs(args.ContainerID, args.IfName); err != nil {
			return nil, nil, err
		}
		c.owner = owner(args.ContainerID, args.IfName)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	c.ctx = ctx
	return c, cancel, nil
}

func cmdAdd(args *skel.CmdArgs) error {
	cl, cancel, err := begin(args, true)
	if err != nil {
		return err
	}
	defer cancel()
	conf, ctx, c, o := cl.conf, cl.ctx, cl.client, cl.owner
	if err := conf.IPAM.checkPools(); err != nil {
		return err
	}

	result := &types100.Result{CNIVersion: types100.ImplementedSpecVersion}
	for i, fam := range conf.IPAM.families() {
		a, err := c.Allocate(ctx, ipamapi.AllocationRequest{Owner: o, Family: fam, RouteTable: conf.IPAM.RouteTable})
		if err != nil {
			err = agentError(conf.IPAM.SocketPath, fmt.Sprintf("allocate an %s address for %s", fam, o), err)
			if i == 0 {
				return err
			}
			// Do not keep the IPv4 address of a failed dual-stack ADD.
			if rerr := c.ReleaseOwner(ctx, o); rerr != nil && !isNotFound(rerr) {
				err = fmt.Errorf("%w; releasing %s again also failed: %v", err, o, rerr)
			}
			return err
		}
		if err := addIP(result, a.IP, a.Pool, conf.IPAM); err != nil {
			// A config error: keep nothing of this ADD.
			if rerr := c.ReleaseOwner(ctx, o); rerr != nil && !isNotFound(rerr) {
				err = fmt.Errorf("%w; releasing %s again also failed: %v", err, o, rerr)
			}
			return types.NewError(types.ErrInvalidNetworkConfig, "ipmasq-cni: "+err.Error(), "")
		}
	}
	return types.PrintResult(result, conf.CNIVersion)
}

// addIP adds an address, its gateway and a default route to a result.
//
// The address carries its pool's prefix length, and the IPv4 gateway is
// the pool's first address, which the agent reserves for it (as host-local
// does) and never hands out; it is on link when the main plugin adds the
// default route (the kernel refuses a
// gateway it cannot reach, and ptp applies the result's routes before its
// own). ptp puts the gateway on every host-side veth. The IPv6 gateway is
// fe80::1.
func addIP(r *types100.Result, ip netip.Addr, answeredPool string, conf ipamConf) error {
	pool, err := conf.pool(ip, answeredPool)
	if err != nil {
		return err
	}
	gw := net.IP(pool.Addr().Next().AsSlice())
	dst := net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
	if ip.Is6() {
		gw, dst = gateway6, net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	r.IPs = append(r.IPs, &types100.IPConfig{
		Address: net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(pool.Bits(), ip.BitLen())},
		Gateway: gw,
	})
	r.Routes = append(r.Routes, &types.Route{Dst: dst, GW: gw})
	return nil
}

func cmdDel(args *skel.CmdArgs) error {
	cl, cancel, err := begin(args, true)
	if err != nil {
		return err
	}
	defer cancel()
	err = cl.client.ReleaseOwner(cl.ctx, cl.owner)
	var answered *ipamapi.Error
	switch {
	case err == nil || isNotFound(err):
		return nil
	case errors.As(err, &answered):
		// The agent answered and refused: the runtime retries.
		return agentError(cl.conf.IPAM.SocketPath, "release the addresses of "+cl.owner, err)
	}
	// The agent is unreachable (restarting, stopped, uninstalled): a DEL
	// that failed would keep the pod Terminating. The agent releases the
	// addresses from a record in its state directory when it is back, and
	// holds them until then, so none is handed out twice.
	stateDir := cl.conf.IPAM.stateDir()
	werr := ipamapi.WritePendingRelease(stateDir, cl.owner)
	switch {
	case werr == nil:
		fmt.Fprintf(os.Stderr, "ipmasq-cni: ipmasq-agent at %s is unreachable (%v); the release of %s is recorded in %s for the agent to do when it is back\n",
			cl.conf.IPAM.SocketPath, err, cl.owner, ipamapi.PendingReleaseDir(stateDir))
		return nil
	case errors.Is(werr, ipamapi.ErrNoAgentState):
		// No agent was ever installed there, or it was uninstalled with
		// its state: nothing holds the addresses any more.
		return nil
	}
	return types.NewError(types.ErrTryAgainLater,
		fmt.Sprintf("ipmasq-cni: could not release the addresses of %s: ipmasq-agent API at %s is unreachable, and recording the release for later also failed: %v",
			cl.owner, cl.conf.IPAM.SocketPath, werr),
		err.Error())
}

func cmdCheck(args *skel.CmdArgs) error {
	cl, cancel, err := begin(args, true)
	if err != nil {
		return err
	}
	defer cancel()
	conf, o := cl.conf, cl.owner
	all, err := cl.client.List(cl.ctx)
	if err != nil {
		return agentError(conf.IPAM.SocketPath, "list allocations to check "+o, err)
	}
	var held []netip.Addr
	for _, a := range all {
		if a.Owner == o {
			held = append(held, a.IP)
		}
	}
	for _, fam := range conf.IPAM.families() {
		if !slices.ContainsFunc(held, func(ip netip.Addr) bool { return ip.Is6() == (fam == "ipv6") }) {
			return types.NewError(types.ErrUnknownContainer,
				fmt.Sprintf("ipmasq-cni: ipmasq-agent at %s holds no %s address for %s", conf.IPAM.SocketPath, fam, o), "")
		}
	}
	// The addresses the runtime was given must still be the owner's.
	if err := version.ParsePrevResult(&conf.PluginConf); err != nil {
		return err
	}
	if conf.PrevResult == nil {
		return nil
	}
	prev, err := types100.NewResultFromResult(conf.PrevResult)
	if err != nil {
		return err
	}
	for _, ipc := range prev.IPs {
		ip, ok := netip.AddrFromSlice(ipc.Address.IP)
		if !ok || !slices.Contains(held, ip.Unmap()) {
			return types.NewError(types.ErrUnknownContainer,
				fmt.Sprintf("ipmasq-cni: %s has %s, but ipmasq-agent at %s holds %v for it", o, ipc.Address.IP, conf.IPAM.SocketPath, held), "")
		}
	}
	return nil
}

// cmdGC releases the addresses of attachments the runtime no longer has.
// Only owners shaped "<containerID>/<ifname>" are considered: other
// clients of the agent name their owners differently.
func cmdGC(args *skel.CmdArgs) error {
	cl, cancel, err := begin(args, false)
	if err != nil {
		return err
	}
	defer cancel()
	conf, ctx, c := cl.conf, cl.ctx, cl.client
	all, err := c.List(ctx)
	if err != nil {
		return agentError(conf.IPAM.SocketPath, "list allocations for GC", err)
	}
	valid := map[string]bool{}
	for _, a := range conf.ValidAttachments {
		valid[owner(a.ContainerID, a.IfName)] = true
	}
	var errs []error
	done := map[string]bool{}
	for _, a := range all {
		if _, _, ok := isAttachmentOwner(a.Owner); !ok || valid[a.Owner] || done[a.Owner] {
			continue
		}
		done[a.Owner] = true
		if err := c.ReleaseOwner(ctx, a.Owner); err != nil && !isNotFound(err) {
			// Go on: GC should remove as much as it can.
			errs = append(errs, fmt.Errorf("release %s: %w", a.Owner, err))
		}
	}
	if len(errs) > 0 {
		return agentError(conf.IPAM.SocketPath, "GC", errors.Join(errs...))
	}
	return nil
}

// cmdStatus succeeds when the agent answers.
func cmdStatus(args *skel.CmdArgs) error {
	cl, cancel, err := begin(args, false)
	if err != nil {
		return err
	}
	defer cancel()
	if _, err := cl.client.List(cl.ctx); err != nil {
		return types.NewError(types.ErrPluginNotAvailable,
			fmt.Sprintf("ipmasq-cni: ipmasq-agent at %s does not answer", cl.conf.IPAM.SocketPath), err.Error())
	}
	return nil
}

func isNotFound(err error) bool {
	var e *ipamapi.Error
	return errors.As(err, &e) && e.Status == http.StatusNotFound
}

// agentError turns a failed API call into a CNI error that says what was
// being done and where. An agent that is down or still waiting for its
// config is "try again later" (11): the runtime retries.
func agentError(socket, what string, err error) error {
	var e *ipamapi.Error
	if !errors.As(err, &e) {
		// The client's error names the socket too: keep only its cause.
		if cause := errors.Unwrap(err); cause != nil {
			err = cause
		}
		return types.NewError(types.ErrTryAgainLater,
			fmt.Sprintf("ipmasq-cni: could not %s: ipmasq-agent API at %s is unreachable (is ipmasq-agent running with that --api-socket?)", what, socket),
			err.Error())
	}
	code := types.ErrInternal
	switch e.Status {
	case http.StatusServiceUnavailable:
		code = types.ErrTryAgainLater
	case http.StatusBadRequest:
		code = types.ErrInvalidNetworkConfig
	}
	return types.NewError(code, fmt.Sprintf("ipmasq-cni: could not %s: ipmasq-agent at %s answered: %s", what, socket, e.Message), "")
}
