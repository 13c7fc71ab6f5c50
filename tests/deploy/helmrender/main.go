// helmrender renders a Helm chart as `helm template` does, for CI on
// machines without helm (not packaged for Debian): Go's text/template with
// sprig's functions (Helm's own template language, from Debian's
// golang-github-masterminds-sprig-dev) and Helm's additions the chart uses
// (include, toYaml, required, fail, tpl), the values file merged under the
// values files given, and .Release, .Chart, .Template, .Capabilities.
//
//	helmrender CHART_DIR RELEASE NAMESPACE [VALUES.yaml ...] > manifests.yaml
//
// Prints every template but NOTES.txt and the _ partials as one YAML
// stream, each document headed "# Source: <chart>/templates/<file>"; NOTES.txt
// goes to stderr. Exits 1 with the template's message on any error.
package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
	yaml2 "gopkg.in/yaml.v2"
	yaml3 "gopkg.in/yaml.v3"
)

func die(f string, a ...interface{}) {
	fmt.Fprintf(os.Stderr, "helmrender: "+f+"\n", a...)
	os.Exit(1)
}

func loadYAML(path string) map[string]interface{} {
	b, err := os.ReadFile(path)
	if err != nil {
		die("%v", err)
	}
	m := map[string]interface{}{}
	if err := yaml3.Unmarshal(b, &m); err != nil {
		die("%s: %v", path, err)
	}
	return m
}

// mergeValues lays over onto base as Helm does: maps merge key by key,
// anything else is replaced, and null deletes the key.
func mergeValues(base, over map[string]interface{}) map[string]interface{} {
	for k, v := range over {
		if v == nil {
			delete(base, k)
			continue
		}
		bm, ok1 := base[k].(map[string]interface{})
		om, ok2 := v.(map[string]interface{})
		if ok1 && ok2 {
			base[k] = mergeValues(bm, om)
		} else {
			base[k] = v
		}
	}
	return base
}

func main() {
	if len(os.Args) < 4 {
		die("usage: helmrender CHART_DIR RELEASE NAMESPACE [VALUES.yaml ...]")
	}
	dir, release, ns := os.Args[1], os.Args[2], os.Args[3]
	meta := loadYAML(filepath.Join(dir, "Chart.yaml"))
	if meta["apiVersion"] != "v2" {
		die("Chart.yaml: apiVersion %v, want v2", meta["apiVersion"])
	}
	for _, k := range []string{"name", "version"} {
		if s, _ := meta[k].(string); s == "" {
			die("Chart.yaml: no %s", k)
		}
	}
	chart := map[string]interface{}{}
	for k, v := range meta { // Helm's .Chart fields are capitalised
		chart[strings.ToUpper(k[:1])+k[1:]] = v
	}
	name := meta["name"].(string)
	values := loadYAML(filepath.Join(dir, "values.yaml"))
	for _, f := range os.Args[4:] {
		values = mergeValues(values, loadYAML(f))
	}

	root := template.New("chart")
	funcs := sprig.TxtFuncMap()
	delete(funcs, "env") // Helm leaves these out: a chart must not read
	delete(funcs, "expandenv")
	funcs["toYaml"] = func(v interface{}) string {
		b, err := yaml2.Marshal(v)
		if err != nil {
			return ""
		}
		return strings.TrimSuffix(string(b), "\n")
	}
	funcs["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil || v == "" {
			return nil, errors.New(msg)
		}
		return v, nil
	}
	funcs["fail"] = func(msg string) (string, error) { return "", errors.New(msg) }
	funcs["include"] = func(n string, data interface{}) (string, error) {
		var b bytes.Buffer
		err := root.ExecuteTemplate(&b, n, data)
		return b.String(), err
	}
	funcs["tpl"] = func(text string, data interface{}) (string, error) {
		t, err := root.Clone()
		if err != nil {
			return "", err
		}
		if t, err = t.New("tpl").Parse(text); err != nil {
			return "", err
		}
		var b bytes.Buffer
		err = t.Execute(&b, data)
		return b.String(), err
	}
	root.Funcs(funcs).Option("missingkey=zero")

	tdir := filepath.Join(dir, "templates")
	files, err := os.ReadDir(tdir)
	if err != nil {
		die("%v", err)
	}
	var names []string
	for _, f := range files {
		if f.IsDir() {
			continue
		}
		b, err := os.ReadFile(filepath.Join(tdir, f.Name()))
		if err != nil {
			die("%v", err)
		}
		n := name + "/templates/" + f.Name()
		if _, err := root.New(n).Parse(string(b)); err != nil {
			die("%v", err)
		}
		names = append(names, n)
	}
	sort.Strings(names)
	top := map[string]interface{}{
		"Values":  values,
		"Chart":   chart,
		"Release": map[string]interface{}{"Name": release, "Namespace": ns, "Service": "Helm", "IsInstall": true, "IsUpgrade": false, "Revision": 1},
		"Capabilities": map[string]interface{}{
			"KubeVersion": map[string]interface{}{"Version": "v1.30.0", "Major": "1", "Minor": "30"},
		},
	}
	var out bytes.Buffer
	for _, n := range names {
		base := filepath.Base(n)
		if strings.HasPrefix(base, "_") {
			continue
		}
		top["Template"] = map[string]interface{}{"Name": n, "BasePath": name + "/templates"}
		var b bytes.Buffer
		if err := root.ExecuteTemplate(&b, n, top); err != nil {
			die("%v", err)
		}
		text := strings.ReplaceAll(b.String(), "<no value>", "")
		if base == "NOTES.txt" {
			fmt.Fprint(os.Stderr, text)
			continue
		}
		for _, doc := range strings.Split(text, "\n---") {
			if strings.TrimSpace(stripComments(doc)) == "" {
				continue
			}
			fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", n, strings.Trim(doc, "\n"))
		}
	}
	os.Stdout.Write(out.Bytes())
}

func stripComments(doc string) string {
	var keep []string
	for _, l := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "\n")
}
