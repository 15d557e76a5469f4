// Command ipmasq-cni is a CNI IPAM plugin that takes pod addresses from the
// ipmasq-agent running on the node, over its API socket. The agent then
// owns the address: it persists it, derives the endpoint's ip rules from
// the masquerade config, and releases both when the plugin says DEL.
//
// It is meant to sit under a point-to-point main plugin such as ptp:
//
//	{
//	  "cniVersion": "1.1.0",
//	  "name": "pods",
//	  "plugins": [{
//	    "type": "ptp",
//	    "ipam": {
//	      "type": "ipmasq-cni",
//	      "socketPath": "/run/ipmasq/api.sock",
//	      "routeTable": 11,
//	      "ipv6": true
//	    }
//	  }]
//	}
//
// socketPath defaults to the agent's default --api-socket;
// routeTable defaults to the agent's --egress-route-table; ipv6 (default
// false) adds an IPv6 address to the IPv4 one. podCIDRs (optional) lists
// the agent's --pod-cidr values; without it each allocation's pool comes
// from the agent's answer. Unknown ipam keys are rejected.
//
// Every attachment is one owner "<containerID>/<ifname>" in the agent. ADD
// allocates (idempotent per owner), DEL releases (an owner already gone is
// success), CHECK finds the owner's addresses, GC releases owners of that
// shape that are not in the runtime's list of valid attachments, STATUS
// asks the agent whether it answers. An agent that cannot be reached, or
// has no config yet, is error 11 "try again later", naming the socket.
//
// The result gives each address its pool's prefix length and a default
// route. The IPv4 gateway is the pool's first address: the agent reserves
// it and never hands it out, so it is never a pod, and it is on link when the default route through it
// is added. ptp puts it on every host-side veth and routes all the pod's
// traffic, to other pods too, through it. The IPv6 gateway is fe80::1.
package main

import (
	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/version"
)

func main() {
	skel.PluginMainFuncs(skel.CNIFuncs{
		Add:    cmdAdd,
		Del:    cmdDel,
		Check:  cmdCheck,
		GC:     cmdGC,
		Status: cmdStatus,
	}, version.All, "ipmasq-cni: IPAM from ipmasq-agent")
}
