package agentlock

import (
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestAcquireHeldRelease(t *testing.T) {
	dir := t.TempDir() + "/state"
	if held, err := Held(dir); held || err != nil {
		t.Fatalf("Held before any lock: %v %v", held, err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("Held created %s", dir)
	}
	l, err := Acquire(dir)
	if err != nil {
		t.Fatal(err)
	}
	pid := "(pid " + strconv.Itoa(os.Getpid()) + ")"
	// flock locks belong to the open file: a second open in this process
	// conflicts like another process would.
	if _, err := Acquire(dir); !errors.Is(err, ErrHeld) || !strings.Contains(err.Error(), pid) {
		t.Fatalf("second Acquire: %v, want ErrHeld naming %s", err, pid)
	}
	if held, err := Held(dir); !held || !errors.Is(err, ErrHeld) {
		t.Fatalf("Held while locked: %v %v", held, err)
	}
	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
	if held, err := Held(dir); held || err != nil {
		t.Fatalf("Held after Release: %v %v", held, err)
	}
	l2, err := Acquire(dir)
	if err != nil {
		t.Fatalf("Acquire after Release: %v", err)
	}
	l2.Release()
}

// TestLockEndsWithProcess: a killed holder's lock is gone (the kernel drops
// flocks with the last file descriptor), so a stale file blocks nothing.
func TestLockEndsWithProcess(t *testing.T) {
	dir := t.TempDir()
	// flock(1) from util-linux takes the lock and becomes sleep (--no-fork),
	// so one process holds it, and Wait returns once it is gone.
	cmd := exec.Command("flock", "--exclusive", "--no-fork", Path(dir), "sleep", "60")
	kill := func() { cmd.Process.Kill() }
	if err := cmd.Start(); err != nil {
		t.Fatalf("flock(1): %v", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if held, _ := Held(dir); held {
			break
		}
		if time.Now().After(deadline) {
			kill()
			t.Fatal("the flock(1) child never held the lock")
		}
		time.Sleep(10 * time.Millisecond)
	}
	kill()
	cmd.Wait()
	if held, err := Held(dir); held || err != nil {
		t.Fatalf("Held after the holder was killed: %v %v", held, err)
	}
}
