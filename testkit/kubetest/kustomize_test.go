package kubetest

import (
	"strings"
	"testing"
)

// A tag that reads as a YAML number (1, 1.2) is still a tag.
func TestKustomizeNumericTag(t *testing.T) {
	for _, image := range []string{"localhost/a/agent:1", "localhost:5000/agent:1.2"} {
		out := string(Kustomize(t, "../../deploy", image))
		if !strings.Contains(out, "image: "+image+"\n") {
			t.Errorf("image %s: rendered\n%s", image, out)
		}
	}
}
