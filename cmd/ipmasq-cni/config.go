package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/utils"

	"github.com/ipmasq/ipmasq/ipamapi"
)

// netConf is the network configuration the runtime passes on stdin.
type netConf struct {
	types.PluginConf
	IPAM ipamConf `json:"ipam"`
}

// ipamConf is the "ipam" object of the network configuration.
type ipamConf struct {
	Type string `json:"type"`
	// SocketPath is the agent's --api-socket.
	SocketPath string `json:"socketPath,omitempty"`
	// RouteTable is the route table of the endpoint's ip rules; nil leaves
	// it to the agent's --egress-route-table.
	RouteTable *uint32 `json:"routeTable,omitempty"`
	// IPv6 asks for an IPv6 address besides the IPv4 one.
	IPv6 bool `json:"ipv6,omitempty"`
	// PodCIDRs are the agent's --pod-cidr pools, optional: by default the
	// pool comes with each allocation. The pool gives the address its
	// prefix length and, for IPv4, its gateway.
	PodCIDRs []netip.Prefix `json:"podCIDRs,omitempty"`
	// StateDir is the agent's --state-dir, optional (default
	// /var/lib/ipmasq): a DEL that cannot reach the agent records the
	// release there for the agent to do when it is back.
	StateDir string `json:"stateDir,omitempty"`
}

// stateDir is StateDir or the agent's default.
func (c ipamConf) stateDir() string {
	if c.StateDir != "" {
		return c.StateDir
	}
	return ipamapi.DefaultStateDir
}

// checkPools makes sure every family ADD asks for has a pod CIDR, before
// anything is allocated, when the config lists them.
func (c ipamConf) checkPools() error {
	if len(c.PodCIDRs) == 0 {
		return nil // the agent tells the pool with each address
	}
	for _, fam := range c.families() {
		if !slices.ContainsFunc(c.PodCIDRs, func(p netip.Prefix) bool { return p.Addr().Is6() == (fam == "ipv6") }) {
			return types.NewError(types.ErrInvalidNetworkConfig,
				fmt.Sprintf("ipmasq-cni: ipam.podCIDRs %v has no %s prefix; list the agent's --pod-cidr values, e.g. [\"10.244.1.0/24\", \"fd00:10:244:1::/64\"]", c.PodCIDRs, fam), "")
		}
	}
	return nil
}

// pool returns the pod CIDR that holds ip: from the config when it lists
// them, else the pool the agent answered with.
func (c ipamConf) pool(ip netip.Addr, answered string) (netip.Prefix, error) {
	if len(c.PodCIDRs) == 0 {
		p, err := netip.ParsePrefix(answered)
		if err != nil || !p.Contains(ip) {
			return netip.Prefix{}, fmt.Errorf("ipmasq-agent handed out %s without its pool (%q); set ipam.podCIDRs to the agent's --pod-cidr values", ip, answered)
		}
		return p, nil
	}
	for _, p := range c.PodCIDRs {
		if p.Contains(ip) {
			return p, nil
		}
	}
	return netip.Prefix{}, fmt.Errorf("ipmasq-agent handed out %s, which is in none of ipam.podCIDRs %v; list every --pod-cidr of the agent", ip, c.PodCIDRs)
}

// families are the address families to allocate, in result order.
func (c ipamConf) families() []string {
	if c.IPv6 {
		return []string{"ipv4", "ipv6"}
	}
	return []string{"ipv4"}
}

// parseConfig reads the network configuration. Unknown keys in "ipam" are
// an error, so that a misspelt "routeTable" does not silently fall back to
// the agent's default.
func parseConfig(stdin []byte) (*netConf, error) {
	var raw struct {
		types.PluginConf
		IPAM json.RawMessage `json:"ipam"`
	}
	if err := json.Unmarshal(stdin, &raw); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "ipmasq-cni: network configuration is not valid JSON", err.Error())
	}
	if len(raw.IPAM) == 0 {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, `ipmasq-cni: network configuration has no "ipam" object`, "")
	}
	conf := &netConf{PluginConf: raw.PluginConf}
	dec := json.NewDecoder(bytes.NewReader(raw.IPAM))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&conf.IPAM); err != nil {
		return nil, types.NewError(types.ErrInvalidNetworkConfig,
			`ipmasq-cni: bad "ipam" object; accepted keys are type, socketPath, routeTable (uint32), ipv6 (bool), podCIDRs (list of prefixes)`, err.Error())
	}
	for _, p := range conf.IPAM.PodCIDRs {
		if p != p.Masked() {
			return nil, types.NewError(types.ErrInvalidNetworkConfig,
				fmt.Sprintf("ipmasq-cni: ipam.podCIDRs: %s has host bits set; did you mean %s (as in --pod-cidr)?", p, p.Masked()), "")
		}
	}
	if conf.IPAM.SocketPath == "" {
		conf.IPAM.SocketPath = ipamapi.DefaultSocket
	}
	return conf, nil
}

// owner is the agent's owner of the attachment's addresses.
func owner(containerID, ifName string) string { return containerID + "/" + ifName }

// isAttachmentOwner reports whether an owner has the shape owner() makes,
// so that GC never touches addresses that other clients of the agent hold.
func isAttachmentOwner(o string) (containerID, ifName string, ok bool) {
	containerID, ifName, ok = strings.Cut(o, "/")
	if !ok || utils.ValidateContainerID(containerID) != nil || utils.ValidateInterfaceName(ifName) != nil {
		return "", "", false
	}
	return containerID, ifName, true
}

func checkArgs(containerID, ifName string) error {
	if err := utils.ValidateContainerID(containerID); err != nil {
		return err
	}
	if err := utils.ValidateInterfaceName(ifName); err != nil {
		return err
	}
	return nil
}
