package tables

import (
	"slices"
	"testing"
)

func TestKubernetesNodeRow(t *testing.T) {
	n := &KubernetesNode{Name: "n1", State: NodeReadFailed, Error: "forbidden"}
	if got, want := n.TableRow(), []string{"n1", "failed", "forbidden"}; !slices.Equal(got, want) {
		t.Fatalf("row %q, want %q", got, want)
	}
	if len(n.TableHeader()) != len(n.TableRow()) {
		t.Fatal("header and row differ in length")
	}
	for _, s := range []NodeReadState{NodeReading, NodeNotFound, NodeReadFailed} {
		if (&KubernetesNode{State: s}).Readable() {
			t.Errorf("%s is readable", s)
		}
	}
	if !(&KubernetesNode{State: NodeRead}).Readable() {
		t.Error("read is not readable")
	}
}
