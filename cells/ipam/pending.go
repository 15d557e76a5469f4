package ipam

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/cilium/hive/cell"

	"github.com/ipmasq/ipmasq/ipamapi"
)

// pendingInterval is how often a running agent looks for releases that
// ipmasq-cni recorded while it could not reach the API (a socket removed
// under the agent, a stop in progress).
const pendingInterval = 10 * time.Second

// releasePending does the releases ipmasq-cni recorded in the state
// directory while the agent was unreachable (ipamapi.WritePendingRelease),
// and removes each record once its release is on disk. The addresses stay
// allocated until then, so none is handed out while its release is
// pending; the release is by owner, so a record done twice frees nothing
// of another owner. It runs in the start hook, before the API serves, and
// every pendingInterval after.
func (i *IPAM) releasePending() error {
	recs, err := ipamapi.PendingReleases(i.stateDir)
	var errs []error
	if err != nil {
		errs = append(errs, err)
	}
	for _, r := range recs {
		if err := i.releaseRecorded(r); err != nil {
			errs = append(errs, err)
		}
	}
	err = errors.Join(errs...)
	if err != nil {
		i.pendingHealth.Degraded("releases recorded by ipmasq-cni are not done; their addresses stay allocated", err)
	} else {
		i.pendingHealth.OK(fmt.Sprintf("%d release(s) recorded by ipmasq-cni done", len(recs)))
	}
	return err
}

// releaseRecorded does one recorded release and removes its record.
func (i *IPAM) releaseRecorded(r ipamapi.PendingRelease) error {
	released, err := i.ReleaseOwner(r.Owner)
	if err != nil && !errors.Is(err, ErrNotFound) {
		return fmt.Errorf("release %s recorded in %s: %w", r.Owner, r.Path, err)
	}
	for _, ep := range released {
		i.log.Info("Released as ipmasq-cni recorded while the agent was unreachable", "ip", ep.IP, "owner", ep.Owner, "record", r.Path)
	}
	if err := os.Remove(r.Path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", r.Path, err)
	}
	return nil
}

// releasePendingOf does the recorded release of owner, if there is one,
// before an allocation for that owner: its ADD comes after its DEL.
func (i *IPAM) releasePendingOf(owner string) error {
	path := ipamapi.PendingReleaseFile(ipamapi.PendingReleaseDir(i.stateDir), owner)
	if _, err := os.Lstat(path); err != nil {
		return nil
	}
	return i.releaseRecorded(ipamapi.PendingRelease{Owner: owner, Path: path})
}

// watchPending runs releasePending every pendingInterval.
func (i *IPAM) watchPending(ctx context.Context, _ cell.Health) error {
	t := time.NewTicker(pendingInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			i.releasePending()
		}
	}
}
