package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/golang/protobuf/proto"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	pb "kvdinterop/kvdepot/v1"
)

const (
	f16  = pb.DType_DTYPE_F16
	bf16 = pb.DType_DTYPE_BF16
	f32  = pb.DType_DTYPE_F32
)

type suite struct {
	args           args
	passed, failed int
	workdir        string
	server         *server
	api            *api
	refs           map[string]*reference // sequence id -> what it holds
	B              int                   // page tokens
	largeDigest    *[32]byte
	chain          []uint64 // the prefix chain of the prefix check
}

func newSuite(a args, workdir string) *suite {
	return &suite{args: a, workdir: workdir, server: newServer(a.kvdepotd, workdir),
		refs: map[string]*reference{}}
}

func (s *suite) connect() {
	s.server.start(60 * time.Second)
	a, err := dial(s.server.addr, nil, "", 30*time.Second)
	if err != nil {
		fail("connect to %s: %v", s.server.addr, err)
	}
	s.api = a
}

func (s *suite) run(name string, fn func()) {
	t0 := time.Now()
	why := try(fn)
	if why == "" {
		s.passed++
		fmt.Printf("ok   %-28s (%.2f s)\n", name, time.Since(t0).Seconds())
		return
	}
	s.failed++
	fmt.Printf("FAIL %-28s %s\n", name, why)
	if s.server.cmd != nil && !s.server.alive() {
		fmt.Printf("     kvdepotd died (%s); log tail:\n%s\n", s.server.exit, s.server.logTail(40))
	}
}

// tuple formats values for comparison: "a,b,c".
func tuple(xs ...interface{}) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprint(x)
	}
	return strings.Join(parts, ",")
}

// ---------------------------------------------------------------------------
// Helpers

func model(name string, layers, kvHeads, qHeads, headDim uint32, dtype pb.DType) *pb.Model {
	return &pb.Model{Name: name, Revision: "interop", NumLayers: layers, NumKvHeads: kvHeads,
		NumQHeads: qHeads, HeadDim: headDim, Dtype: dtype}
}

func (s *suite) create(id, model string, codecs *pb.SequenceCodecs) (*pb.SequenceInfo, error) {
	return s.api.create(&pb.CreateSequenceRequest{SequenceId: []byte(id), Model: model,
		Codecs: codecs})
}

func (s *suite) appendRef(id string, ref *reference, layerStart, numLayers, numTokens int, o appendOpts) *pb.AppendResponse {
	tokenStart := ref.tokens(layerStart)
	data := ref.makeAppend(numLayers, numTokens)
	o.layerStart, o.numLayers = uint32(layerStart), uint32(numLayers)
	r := must(s.api.append(id, data, uint64(tokenStart), uint64(numTokens), o))
	ref.commit(layerStart, numLayers, numTokens, data)
	eq(r.BytesReceived, uint64(len(data)), "AppendResponse.bytes_received")
	lt := r.Sequence.GetLayerTokens()
	check(len(lt) >= layerStart+numLayers, "AppendResponse layer_tokens %v too short", lt)
	eq(lt[layerStart:layerStart+numLayers], ref.layerTokens()[layerStart:layerStart+numLayers],
		"layer_tokens after Append")
	return r
}

// verify checks that a stored sequence equals its reference: stat and a full
// read.
func (s *suite) verify(id, what string) {
	ref := s.refs[id]
	n := ref.minTokens()
	info := must(s.api.stat(id))
	eq(info.NumTokens, uint64(n), what+" num_tokens")
	eq(info.LayerTokens, ref.layerTokens(), what+" layer_tokens")
	if n == 0 {
		return
	}
	r := must(s.api.read(id, readOpts{}))
	h := r.header
	eq(tuple(h.LayerStart, h.NumLayers, h.TokenStart, h.NumTokens),
		tuple(0, ref.numLayers, 0, n), what+" read header range")
	check(bytes.Equal(r.data, ref.wire(0, ref.numLayers, 0, n)),
		"%s: bytes read back differ from what was appended", what)
}

// expectUnchanged requires the error and then that the sequence is as before.
func (s *suite) expectUnchanged(id string, err error, want ...codes.Code) {
	expectCode(err, want...)
	check(s.server.alive(), "kvdepotd died")
	s.verify(id, "after the failed call, sequence")
}

func (s *suite) lookup(model string, hashes []uint64) string {
	r := must(s.api.lookup(model, hashes))
	return tuple(r.MatchedBlocks, r.MatchedTokens)
}

// ---------------------------------------------------------------------------
// Models

func (s *suite) tHealth() {
	r := must(s.api.healthCheck(""))
	eq(r.Status, healthpb.HealthCheckResponse_SERVING, "Health/Check status")
	expectCode(errOf(s.api.healthCheck("no.such.Service")), codes.NotFound)
}

func (s *suite) tModels() {
	m := model("go-f16", 3, 2, 4, 64, f16)
	r := must(s.api.putModel(m, false))
	check(r.Created, "first PutModel reports created=false")
	eq(tuple(r.Model.Name, r.Model.NumLayers, r.Model.NumKvHeads, r.Model.HeadDim, r.Model.Dtype),
		tuple("go-f16", 3, 2, 64, f16), "PutModel echo")
	r2 := must(s.api.putModel(m, false))
	check(!r2.Created, "identical PutModel again reports created=true")
	g := must(s.api.getModel("go-f16"))
	eq(tuple(g.NumLayers, g.NumKvHeads, g.NumQHeads, g.HeadDim, g.Dtype), tuple(3, 2, 4, 64, f16),
		"GetModel shape")
	check(g.CreatedUnixMs > 0, "GetModel created_unix_ms not set")
	names := must(s.api.listModels())
	check(contains(names, "go-f16"), "ListModels lacks go-f16: %v", names)
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

func (s *suite) tModelErrors() {
	expectCode(errOf(s.api.putModel(model("go-f16", 4, 2, 4, 64, f16), false)), codes.AlreadyExists)
	expectCode(errOf(s.api.getModel("go-nope")), codes.NotFound)
	long := model("go-bad", 2, 2, 0, 64, f16)
	long.Revision = strings.Repeat("r", 129)
	bad := []struct {
		m   *pb.Model
		why string
	}{
		{model("go-bad", 0, 2, 0, 64, f16), "num_layers 0"},
		{model("go-bad", 2, 0, 0, 64, f16), "num_kv_heads 0"},
		{model("go-bad", 2, 2, 0, 0, f16), "head_dim 0"},
		{model("go-bad", 2, 2, 0, 64, pb.DType_DTYPE_UNSPECIFIED), "dtype unspecified"},
		{model("go-bad", 2, 2, 3, 64, f16), "q_heads not a multiple"},
		{model("bad name!", 2, 2, 0, 64, f16), "bad name"},
		{model("", 2, 2, 0, 64, f16), "empty name"},
		{model(strings.Repeat("x", 129), 2, 2, 0, 64, f16), "129-byte name"},
		{model("go-bad", 1025, 2, 0, 64, f16), "num_layers 1025"},
		{model("go-bad", 2, 1025, 0, 64, f16), "num_kv_heads 1025"},
		{model("go-bad", 2, 2, 0, 1025, f16), "head_dim 1025"},
		{long, "129-byte revision"},
	}
	for _, b := range bad {
		if msg := try(func() {
			expectCode(errOf(s.api.putModel(b.m, false)), codes.InvalidArgument)
		}); msg != "" {
			fail("%s: %s", b.why, msg)
		}
	}
	expectCode(errOf(s.api.deleteModel("go-nope", false)), codes.NotFound)
	// The longest valid name is fine.
	must(s.api.putModel(model(strings.Repeat("n", 128), 1, 1, 0, 4, f16), false))
	must(s.api.deleteModel(strings.Repeat("n", 128), false))
	g := must(s.api.getModel("go-f16"))
	eq(tuple(g.NumLayers, g.NumKvHeads, g.HeadDim), tuple(3, 2, 64), "go-f16 after failed PutModels")
	check(!contains(must(s.api.listModels()), "go-bad"), "a rejected model was stored")
}

// ---------------------------------------------------------------------------
// Append and Read

func (s *suite) tRoundtrip() {
	info := must(s.create("go-seq", "go-f16", nil))
	eq(info.NumTokens, uint64(0), "new sequence num_tokens")
	check(info.PageTokens > 0, "page_tokens not reported")
	B := int(info.PageTokens)
	s.B = B
	ref := newReference(3, 2, 64, 2)
	s.refs["go-seq"] = ref
	s.appendRef("go-seq", ref, 0, 3, B+37, appendOpts{chunks: []int{1, 4093, 65536, 3}})
	s.appendRef("go-seq", ref, 0, 3, B+63,
		appendOpts{chunk: 100000, dataWithHeader: true, emptyBetween: true})
	n := 2*B + 100
	s.verify("go-seq", "go-seq")
	st := must(s.api.stat("go-seq"))
	eq(st.NumTokens, uint64(n), "num_tokens")
	eq(st.SealedPages, uint64(3*(n/B)), "sealed_pages (full pages over all layers)")
	raw := len(ref.wire(0, 3, 0, n))
	check(st.StoredBytes >= uint64(raw), "stored_bytes %d below the %d bytes appended",
		st.StoredBytes, raw)
	r := must(s.api.read("go-seq", readOpts{layerStart: 1, numLayers: 1,
		tokenStart: uint64(B - 5), numTokens: 65, maxChunk: 777}))
	eq(tuple(r.header.NumKvHeads, r.header.HeadDim, r.header.Dtype), tuple(2, 64, f16),
		"read header shape")
	check(bytes.Equal(r.data, ref.wire(1, 1, B-5, 65)), "layer 1 tokens [B-5, B+60) differ")
	r = must(s.api.read("go-seq", readOpts{layerStart: 1, tokenStart: 10, maxChunk: 4 * mib}))
	eq(tuple(r.header.NumLayers, r.header.NumTokens), tuple(2, n-10), "open-ended read range")
	check(bytes.Equal(r.data, ref.wire(1, 2, 10, n-10)), "layers 1.. tokens 10.. differ")
}

func (s *suite) tLayerwise() {
	ref := newReference(3, 2, 64, 2)
	s.refs["go-layers"] = ref
	must(s.create("go-layers", "go-f16", nil))
	s.appendRef("go-layers", ref, 0, 1, 50, appendOpts{})
	info := must(s.api.stat("go-layers"))
	eq(info.LayerTokens, []uint64{50, 0, 0}, "layer_tokens after layer 0")
	eq(info.NumTokens, uint64(0), "num_tokens with layers 1,2 empty")
	s.appendRef("go-layers", ref, 1, 2, 50, appendOpts{chunk: 999})
	s.verify("go-layers", "go-layers")
}

// f32 and bf16 models round-trip too; sequence ids are bytes, not text.
func (s *suite) tDtypes() {
	for _, c := range []struct {
		name  string
		dtype pb.DType
		esize int
	}{{"go-f32", f32, 4}, {"go-bf16", bf16, 2}} {
		must(s.api.putModel(model(c.name, 2, 1, 0, 16, c.dtype), false))
		id := "\x00\xff" + c.name + "\x00\n"
		ref := newReference(2, 1, 16, c.esize)
		s.refs[id] = ref
		must(s.create(id, c.name, nil))
		s.appendRef(id, ref, 0, 2, s.B+3, appendOpts{dtype: c.dtype, chunk: 1000})
		s.appendRef(id, ref, 0, 2, 7, appendOpts{dtype: c.dtype})
		s.verify(id, c.name)
		r := must(s.api.read(id, readOpts{numTokens: 1}))
		eq(r.header.Dtype, c.dtype, c.name+" read header dtype")
		s.expectUnchanged(id, errOf(s.api.append(id, make([]byte, 2*2*16*2),
			uint64(ref.tokens(0)), 1, appendOpts{dtype: f16})), codes.InvalidArgument)
		listed := must(s.api.listSequences(&pb.ListSequencesRequest{Model: c.name})).Sequences
		check(len(listed) == 1 && bytes.Equal(listed[0].SequenceId, []byte(id)),
			"ListSequences(%s) ids, byte for byte: %d listed", c.name, len(listed))
	}
}

func (s *suite) tErrorsUnknown() {
	X := "go-seq"
	s.expectUnchanged(X, errOf(s.api.stat("go-none")), codes.NotFound)
	s.expectUnchanged(X, errOf(s.api.read("go-none", readOpts{})), codes.NotFound)
	s.expectUnchanged(X, errOf(s.api.append("go-none", make([]byte, 2*3*256), 0, 1, appendOpts{})),
		codes.NotFound)
	s.expectUnchanged(X, errOf(s.api.deleteSequence("go-none")), codes.NotFound)
	s.expectUnchanged(X, errOf(s.create("go-new", "go-no-model", nil)), codes.NotFound)
	expectCode(errOf(s.api.stat("go-new")), codes.NotFound)
}

func (s *suite) tErrorsCreate() {
	X := "go-seq"
	s.expectUnchanged(X, errOf(s.create(X, "go-f16", nil)), codes.AlreadyExists)
	s.expectUnchanged(X, errOf(s.create("", "go-f16", nil)), codes.InvalidArgument)
	s.expectUnchanged(X, errOf(s.create(strings.Repeat("x", 257), "go-f16", nil)),
		codes.InvalidArgument)
	// The longest valid id is fine.
	longest := make([]byte, 256)
	for i := range longest {
		longest[i] = byte(i)
	}
	info := must(s.create(string(longest), "go-f16", nil))
	check(bytes.Equal(info.SequenceId, longest), "256-byte id")
	must(s.api.deleteSequence(string(longest)))
}

func (s *suite) tErrorsAppend() {
	a := s.api
	X := "go-seq"
	ref := s.refs[X]
	n := uint64(ref.tokens(0))
	good := ref.makeAppend(3, 10)
	third := len(good) / 3
	IA, FP := codes.InvalidArgument, codes.FailedPrecondition
	s.expectUnchanged(X, errOf(a.append(X, good[:len(good)-1], n, 10, appendOpts{chunks: []int{7}})), IA)
	s.expectUnchanged(X, errOf(a.append(X, append(append([]byte(nil), good...), 0), n, 10, appendOpts{})), IA)
	s.expectUnchanged(X, errOf(a.append(X, good, n, 11, appendOpts{})), IA)
	s.expectUnchanged(X, errOf(a.append(X, good, n, 10, appendOpts{dtype: bf16})), IA)
	s.expectUnchanged(X, errOf(a.append(X, append(append([]byte(nil), good...), good...), n, 10,
		appendOpts{dtype: f32})), IA)
	s.expectUnchanged(X, errOf(a.append(X, good, n+1, 10, appendOpts{})), FP)
	s.expectUnchanged(X, errOf(a.append(X, good, 0, 10, appendOpts{})), FP)
	s.expectUnchanged(X, errOf(a.append(X, good[:third], n, 10,
		appendOpts{layerStart: 3, numLayers: 1})), IA)
	s.expectUnchanged(X, errOf(a.append(X, good[:2*third], n, 10,
		appendOpts{layerStart: 2, numLayers: 2})), IA)
	s.expectUnchanged(X, errOf(a.append(X, good, n, 10,
		appendOpts{tokenIDs: []uint32{0, 1, 2, 3, 4, 5, 6, 7, 8}})), IA)
	s.expectUnchanged(X, errOf(a.appendStream([]*pb.AppendRequest{{Data: good}})), IA)
	s.expectUnchanged(X, errOf(a.appendStream(nil)), IA)
	s.appendRef(X, ref, 0, 3, 10, appendOpts{})
	s.verify(X, X)
}

func (s *suite) tErrorsRead() {
	a := s.api
	X := "go-seq"
	n := uint64(s.refs[X].tokens(0))
	OOR, IA := codes.OutOfRange, codes.InvalidArgument
	s.expectUnchanged(X, errOf(a.read(X, readOpts{tokenStart: n, numTokens: 1})), OOR)
	s.expectUnchanged(X, errOf(a.read(X, readOpts{tokenStart: 0, numTokens: n + 1})), OOR)
	s.expectUnchanged(X, errOf(a.read(X, readOpts{tokenStart: n + 5})), OOR)
	// token_start + num_tokens wraps around 2^64: must not wrap into range.
	s.expectUnchanged(X, errOf(a.read(X, readOpts{tokenStart: 1 << 63, numTokens: 1 << 63})), OOR, IA)
	s.expectUnchanged(X, errOf(a.read(X, readOpts{layerStart: 3})), IA, OOR)
	s.expectUnchanged(X, errOf(a.read(X, readOpts{layerStart: 1, numLayers: 3})), IA, OOR)
}

func (s *suite) tErrorsLimits() {
	a := s.api
	X := "go-seq"
	n := uint64(s.refs[X].tokens(0))
	perToken := 2 * 3 * 2 * 64 * 2
	RE, IA := codes.ResourceExhausted, codes.InvalidArgument
	fill := func(size int, b byte) []byte { return bytes.Repeat([]byte{b}, size) }
	// One 12 MiB message: over the server's default 8 MiB message limit.
	s.expectUnchanged(X, errOf(a.append(X, fill(12*mib, 1), n, uint64(12*mib/perToken), appendOpts{})), RE)
	// Sizes that overflow: 2^55 + 1 tokens of 1536 bytes is 1536 modulo 2^64.
	s.expectUnchanged(X, errOf(a.append(X, fill(perToken, 2), n, 36028797018963969, appendOpts{})), IA, RE)
	s.expectUnchanged(X, errOf(a.append(X, fill(1024, 3), n, 1099511627776, appendOpts{})), IA, RE)
	s.expectUnchanged(X, errOf(a.append(X, fill(perToken, 4), n, 18446744073709551615, appendOpts{})), IA, RE)
	// Replacing the shape of a model that has sequences is refused ...
	s.expectUnchanged(X, errOf(a.putModel(model("go-f16", 4, 2, 4, 64, f16), true)),
		codes.FailedPrecondition, codes.AlreadyExists)
	eq(must(a.getModel("go-f16")).NumLayers, uint32(3), "go-f16 num_layers after a refused replace")
	// ... and allowed without sequences.
	must(a.putModel(model("go-rep", 2, 2, 0, 8, f16), false))
	must(a.putModel(model("go-rep", 5, 2, 0, 8, f16), true))
	eq(must(a.getModel("go-rep")).NumLayers, uint32(5), "go-rep num_layers after replace")
}

// A header promising 2^30 tokens (1.5 TiB) with 1 KiB behind it is refused
// before the server sets memory aside for it.
func (s *suite) tHeaderMemory() {
	X := "go-seq"
	n := uint64(s.refs[X].tokens(0))
	before := s.server.vmPeakKib()
	s.expectUnchanged(X, errOf(s.api.append(X, bytes.Repeat([]byte{3}, 1024), n, 1<<30, appendOpts{})),
		codes.InvalidArgument, codes.ResourceExhausted)
	grown := s.server.vmPeakKib() - before
	check(grown < 1024*1024, "an Append header claiming 2^30 tokens grew kvdepotd's peak "+
		"virtual memory by %d MiB before any data arrived", grown/1024)
}

// Bytes no protobuf parser may accept.
var garbage = [][]byte{
	bytes.Repeat([]byte{0xff}, 11),         // long varint
	append([]byte{0x0a, 0x7f}, "short"...), // length past the end
	{0x0f, 0x01},                           // wire type 7
	{0x0a},                                 // tag without a value
	append([]byte{0x08, 0x96, 0x01, 0x12, 0xff, 0xff, 0xff, 0xff, 0x0f}, "junk"...), // 4 GiB length
	[]byte("GET / HTTP/1.1\r\n\r\n"),                                                // text: 'G' is wire type 7
}

func (s *suite) tErrorsGarbage() {
	X := "go-seq"
	for _, m := range []string{"StatSequence", "CreateSequence", "PutModel", "Lookup", "GetModel",
		"DeleteSequence", "ListSequences"} {
		for _, g := range garbage {
			if msg := try(func() {
				s.expectUnchanged(X, errOf(s.api.rawUnary(m, g)), codes.InvalidArgument)
			}); msg != "" {
				fail("%s with %x: %s", m, g, msg)
			}
		}
	}
	for _, g := range garbage {
		s.expectUnchanged(X, s.api.rawStream("Read", true, false, [][]byte{g}), codes.InvalidArgument)
	}
	// Not garbage: fields this version does not know are skipped, as protobuf
	// requires (a newer client talking to this server).
	for _, extra := range [][]byte{{0x78, 0x05}, {0xfa, 0x06, 0x03, 'a', 'b', 'c'},
		{0xf9, 0x07, 0, 0, 0, 0, 0, 0, 0, 0}} {
		raw := must(proto.Marshal(&pb.StatSequenceRequest{SequenceId: []byte(X)}))
		out := must(s.api.rawUnary("StatSequence", append(raw, extra...)))
		var r pb.StatSequenceResponse
		if err := proto.Unmarshal(out, &r); err != nil {
			fail("StatSequence answer does not parse: %v", err)
		}
		eq(r.GetSequence().GetNumTokens(), uint64(s.refs[X].tokens(0)),
			fmt.Sprintf("StatSequence with unknown field %x", extra))
	}
	// Garbage inside an Append stream after a valid header and some data.
	ref := s.refs[X]
	data := ref.makeAppend(3, 4)
	var encoded [][]byte
	for _, m := range appendMsgs([]byte(X), data[:100], uint64(ref.tokens(0)), 4, appendOpts{}) {
		encoded = append(encoded, must(proto.Marshal(m)))
	}
	for _, g := range garbage {
		s.expectUnchanged(X, s.api.rawStream("Append", false, true, append(encoded[:len(encoded):len(encoded)], g)),
			codes.InvalidArgument)
		s.expectUnchanged(X, s.api.rawStream("Append", false, true, [][]byte{g}), codes.InvalidArgument)
	}
}

// ld is a length-delimited protobuf field (strings, bytes, messages).
func ld(field int, b []byte) []byte {
	out := []byte{byte(field<<3 | 2)}
	for n := len(b); ; n >>= 7 {
		if n < 0x80 {
			out = append(out, byte(n))
			break
		}
		out = append(out, byte(n&0x7f|0x80))
	}
	return append(out, b...)
}

// Names are checked byte for byte: a NUL byte or bytes that are not UTF-8
// in any string field are INVALID_ARGUMENT (not a shorter name), and "." and
// ".." are no model names; nothing changes.
func (s *suite) tNames() {
	X := "go-seq"
	bad := [][]byte{[]byte("go-f16\x00x"), []byte("go-f16\xff"), []byte("go-\xc0\x80")}
	for _, name := range bad {
		model := ld(1, name)
		putModel := ld(1, append(append([]byte{}, model...), 0x18, 2, 0x20, 1, 0x30, 8, 0x40, 1))
		del := append(ld(1, name), 0x10, 1) // force
		for _, c := range []struct {
			method string
			msg    []byte
		}{
			{"PutModel", putModel},
			{"GetModel", ld(1, name)},
			{"DeleteModel", del},
			{"CreateSequence", append(ld(1, []byte("go-names")), ld(2, name)...)},
			{"ListSequences", ld(1, name)},
			{"Lookup", ld(1, name)},
		} {
			if msg := try(func() {
				st := expectCode(errOf(s.api.rawUnary(c.method, c.msg)), codes.InvalidArgument)
				check(strings.Contains(st.Message(), "name") || strings.Contains(st.Message(), "model"),
					"message does not name the field: %s", st.Message())
			}); msg != "" {
				fail("%s with %q: %s", c.method, name, msg)
			}
		}
		for _, c := range []struct {
			method string
			msgs   [][]byte
		}{
			{"UploadArtifacts", [][]byte{ld(1, name)}},
			{"Calibrate", [][]byte{ld(1, ld(1, name))}},
		} {
			expectCode(s.api.rawStream(c.method, false, true, c.msgs), codes.InvalidArgument)
		}
		expectCode(s.api.rawStream("GetArtifacts", true, false, [][]byte{ld(1, name)}),
			codes.InvalidArgument)
	}
	// Nothing happened to the model the names start with.
	g := must(s.api.getModel("go-f16"))
	eq(g.NumLayers, uint32(3), "go-f16 after the bad names")
	expectCode(errOf(s.api.stat("go-names")), codes.NotFound)
	s.verify(X, "go-seq after the bad names")
	for _, name := range []string{".", ".."} {
		expectCode(errOf(s.api.putModel(model(name, 2, 1, 0, 8, f16), false)), codes.InvalidArgument)
	}
	check(!contains(must(s.api.listModels()), "."), "a model named . was stored")
}

// An Append is invisible until acknowledged; of two appends racing for the
// same token_start exactly one lands.
func (s *suite) tAppendAtomic() {
	X := "go-seq"
	ref := s.refs[X]
	n := uint64(ref.tokens(0))
	datas := [][]byte{ref.makeAppend(3, 30), ref.makeAppend(3, 30)}
	var streams []pb.KVDepot_AppendClient
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	for _, d := range datas {
		st := must(s.api.kv.Append(ctx))
		first := appendMsgs([]byte(X), d[:len(d)/2], n, 30, appendOpts{dataWithHeader: true})[0]
		if err := st.Send(first); err != nil {
			failErr(err)
		}
		streams = append(streams, st)
	}
	time.Sleep(300 * time.Millisecond)
	s.verify(X, "while two appends are half sent, sequence")
	finish := func(i int) (*pb.AppendResponse, error) {
		if err := streams[i].Send(&pb.AppendRequest{Data: datas[i][len(datas[i])/2:]}); err != nil && err != io.EOF {
			return nil, err
		}
		return streams[i].CloseAndRecv()
	}
	r := must(finish(0))
	eq(r.Sequence.NumTokens, n+30, "num_tokens after the first append")
	ref.commit(0, 3, 30, datas[0])
	expectCode(errOf(finish(1)), codes.FailedPrecondition, codes.Aborted)
	s.verify(X, "after the race, sequence")
}

func (s *suite) tCancelledAppend() {
	X := "go-seq"
	ref := s.refs[X]
	n := uint64(ref.tokens(0))
	data := ref.makeAppend(3, 40)
	ctx, cancel := context.WithCancel(context.Background())
	st := must(s.api.kv.Append(ctx))
	for _, m := range appendMsgs([]byte(X), data[:len(data)/2], n, 40, appendOpts{}) {
		if err := st.Send(m); err != nil {
			break
		}
	}
	time.Sleep(500 * time.Millisecond)
	cancel()
	_, err := st.CloseAndRecv()
	check(err != nil, "cancelled Append succeeded")
	time.Sleep(500 * time.Millisecond)
	check(s.server.alive(), "kvdepotd died")
	s.verify(X, "after a cancelled Append, sequence")
	s.appendRef(X, ref, 0, 3, 40, appendOpts{})
	s.verify(X, X)
}

// Appends and reads from several concurrent streams on one channel.
func (s *suite) tConcurrent() {
	var ids []string
	for i := 0; i < 4; i++ {
		id := fmt.Sprintf("go-conc-%d", i)
		ids = append(ids, id)
		s.refs[id] = newReference(3, 2, 64, 2)
		must(s.create(id, "go-f16", nil))
	}
	var mu sync.Mutex
	var errs []string
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Add(1)
		go func(id string) {
			defer wg.Done()
			if msg := try(func() {
				for i := 0; i < 3; i++ {
					s.appendRef(id, s.refs[id], 0, 3, 97, appendOpts{chunk: 20000})
					must(s.api.read("go-seq", readOpts{maxChunk: 65536}))
					s.verify(id, id)
				}
			}); msg != "" {
				mu.Lock()
				errs = append(errs, id+": "+msg)
				mu.Unlock()
			}
		}(id)
	}
	wg.Wait()
	check(len(errs) == 0, "%s", strings.Join(errs, "; "))
	for _, id := range ids {
		s.verify(id, id)
	}
	s.verify("go-seq", "go-seq")
}

// Deleting a sequence while it is read gives the reader all of it or an
// error, never part; an append racing with a deletion fails; so does one
// racing with a forced model deletion.
func (s *suite) tDeleteRaces() {
	a := s.api
	must(a.putModel(model("go-race", 8, 8, 0, 128, f16), false))
	tokens := uint64(512) // 32 KiB per token: 16 MiB
	data := randomBytes(int(tokens) * 32 * 1024)
	must(s.create("go-race-read", "go-race", nil))
	must(a.append("go-race-read", data, 0, tokens, appendOpts{chunk: mib}))
	type outcome struct {
		err  error
		same bool
	}
	reading := make(chan outcome, 1)
	go func() {
		var o outcome
		if msg := try(func() {
			r, err := a.read("go-race-read", readOpts{maxChunk: mib})
			o.err = err
			o.same = err == nil && bytes.Equal(r.data, data)
		}); msg != "" {
			o.err = fmt.Errorf("%s", msg)
		}
		reading <- o
	}()
	time.Sleep(50 * time.Millisecond)
	must(a.deleteSequence("go-race-read"))
	o := <-reading
	if o.err == nil {
		check(o.same, "read racing with a delete returned other bytes")
	} else {
		expectCode(o.err, codes.NotFound, codes.Aborted)
	}

	racingAppend := func(id string, del func()) {
		must(s.create(id, "go-race", nil))
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		st := must(a.kv.Append(ctx))
		first := appendMsgs([]byte(id), data[:mib], 0, tokens, appendOpts{dataWithHeader: true})[0]
		if err := st.Send(first); err != nil {
			failErr(err)
		}
		time.Sleep(300 * time.Millisecond)
		del()
		for _, p := range split(data[mib:], appendOpts{chunk: mib}) {
			if st.Send(&pb.AppendRequest{Data: p}) != nil {
				break
			}
		}
		_, err := st.CloseAndRecv()
		check(err != nil, "append to %s succeeded across its deletion", id)
		expectCode(err, codes.NotFound, codes.Aborted)
		expectCode(errOf(a.stat(id)), codes.NotFound)
	}
	racingAppend("go-race-a", func() { must(a.deleteSequence("go-race-a")) })
	racingAppend("go-race-b", func() { must(a.deleteModel("go-race", true)) })
	check(s.server.alive(), "kvdepotd died")
	s.verify("go-seq", "go-seq")
}

// ---------------------------------------------------------------------------
// Prefixes

func randomIDs(n int) []uint32 {
	b := randomBytes(4 * n)
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = getU32(b[4*i:])
	}
	return ids
}

func (s *suite) tPrefix() {
	a := s.api
	must(a.putModel(model("go-prefix", 2, 2, 0, 32, f16), false))
	B := s.B
	ids := randomIDs(3*B + 10)
	src := newReference(2, 2, 32, 2)
	s.refs["go-prefix-src"] = src
	must(s.create("go-prefix-src", "go-prefix", nil))
	// Block 0 completes in the second append: the server has to keep the
	// token ids of the first one.
	s.appendRef("go-prefix-src", src, 0, 2, B-56, appendOpts{tokenIDs: ids[:B-56]})
	s.appendRef("go-prefix-src", src, 0, 2, B+66, appendOpts{chunk: 5000, tokenIDs: ids[B-56 : 2*B+10]})
	h := prefixChain(ids, B, 0)
	eq(len(h), 3, "block count")
	eq(must(a.stat("go-prefix-src")).BlockHashes, h[:2], "block_hashes vs the documented xxh3-64 chain")

	bogus := h[1] ^ 0x5a5a5a5a5a5a5a5a
	eq(s.lookup("go-prefix", h[:2]), tuple(2, 2*B), "Lookup of the stored chain")
	eq(s.lookup("go-prefix", h), tuple(2, 2*B), "Lookup of chain + unstored block")
	eq(s.lookup("go-prefix", []uint64{h[0], bogus}), tuple(1, B), "Lookup with a wrong second hash")
	eq(s.lookup("go-prefix", []uint64{bogus, h[1]}), tuple(0, 0), "Lookup with a wrong first hash")
	eq(s.lookup("go-prefix", nil), tuple(0, 0), "Lookup of an empty chain")
	eq(s.lookup("go-f16", h[:2]), tuple(0, 0), "Lookup under another model")
	expectCode(errOf(a.lookup("go-no-model", h[:1])), codes.NotFound)

	dst := src.clonePrefix(2 * B)
	s.refs["go-prefix-dst"] = dst
	created := must(a.create(&pb.CreateSequenceRequest{SequenceId: []byte("go-prefix-dst"),
		Model: "go-prefix", PrefixHashes: h[:2], PrefixTokenIds: ids[:2*B]}))
	eq(tuple(created.NumTokens, created.PrefixBlocks), tuple(2*B, 2), "sequence created from prefix")
	s.verify("go-prefix-dst", "go-prefix-dst")
	s.appendRef("go-prefix-dst", dst, 0, 2, B, appendOpts{tokenIDs: ids[2*B : 3*B]})
	s.verify("go-prefix-dst", "go-prefix-dst")
	eq(must(a.stat("go-prefix-dst")).BlockHashes, h, "block_hashes of the grown sequence")
	eq(s.lookup("go-prefix", h), tuple(3, 3*B), "Lookup after growing from the prefix")
	s.chain = h

	bad := func(hashes []uint64, tokenIDs []uint32) error {
		return errOf(a.create(&pb.CreateSequenceRequest{SequenceId: []byte("go-prefix-bad"),
			Model: "go-prefix", PrefixHashes: hashes, PrefixTokenIds: tokenIDs}))
	}
	s.expectUnchanged("go-prefix-dst", bad([]uint64{h[0], bogus}, nil), codes.NotFound)
	wrongIDs := append([]uint32(nil), ids[:2*B]...)
	wrongIDs[7] ^= 1
	s.expectUnchanged("go-prefix-dst", bad(h[:2], wrongIDs), codes.InvalidArgument)
	s.expectUnchanged("go-prefix-dst", bad(h[:2], ids[:2*B-1]), codes.InvalidArgument)
	expectCode(errOf(a.stat("go-prefix-bad")), codes.NotFound)

	must(a.deleteSequence("go-prefix-src"))
	delete(s.refs, "go-prefix-src")
	s.verify("go-prefix-dst", "prefix sequence after deleting its source:")
}

// Chaining from a prefix given by hashes alone; blocks count only once every
// layer is sealed; prefixes are per model.
func (s *suite) tPrefixMore() {
	a := s.api
	B := s.B
	h := s.chain
	check(h != nil, "needs the prefix check")
	ref := s.refs["go-prefix-dst"].clonePrefix(3 * B)
	s.refs["go-prefix-h"] = ref
	info := must(a.create(&pb.CreateSequenceRequest{SequenceId: []byte("go-prefix-h"),
		Model: "go-prefix", PrefixHashes: h}))
	eq(tuple(info.NumTokens, info.PrefixBlocks), tuple(3*B, 3), "sequence from hashes only")
	ids := randomIDs(B)
	s.appendRef("go-prefix-h", ref, 0, 1, B, appendOpts{tokenIDs: ids})
	eq(must(a.stat("go-prefix-h")).BlockHashes, h, "block_hashes with one layer of block 3 sealed")
	h3 := prefixChain(ids, B, h[2])
	all := append(append([]uint64(nil), h...), h3...)
	eq(must(a.lookup("go-prefix", all)).MatchedBlocks, uint64(3), "Lookup while block 3 lacks a layer")
	s.appendRef("go-prefix-h", ref, 1, 1, B, appendOpts{tokenIDs: ids})
	eq(must(a.stat("go-prefix-h")).BlockHashes, all, "block_hashes chained from a prefix given by hashes only")
	eq(must(a.lookup("go-prefix", all)).MatchedBlocks, uint64(4), "Lookup after block 3 is sealed on every layer")
	s.verify("go-prefix-h", "go-prefix-h")
	s.verify("go-prefix-dst", "the sequence the prefix came from:")
	s.expectUnchanged("go-prefix-h", errOf(a.create(&pb.CreateSequenceRequest{
		SequenceId: []byte("go-prefix-x"), Model: "go-f16", PrefixHashes: h[:1]})), codes.NotFound)
}

func (s *suite) tEngineHashes() {
	B := s.B
	ref := newReference(2, 2, 32, 2)
	s.refs["go-engine"] = ref
	must(s.create("go-engine", "go-prefix", nil))
	// Above 2^63 on purpose: fixed64 must travel unsigned and exact.
	e := []uint64{81985529216486895, 18364758544493064720}
	s.appendRef("go-engine", ref, 0, 2, 2*B+3, appendOpts{blockHashes: e})
	eq(must(s.api.stat("go-engine")).BlockHashes, e, "engine-supplied block_hashes")
	eq(s.lookup("go-prefix", e), tuple(2, 2*B), "Lookup of engine hashes")
	s.verify("go-engine", "go-engine")
}

func (s *suite) tListDelete() {
	a := s.api
	var ids []string
	var token []byte
	for i := 0; i < 100; i++ {
		r := must(a.listSequences(&pb.ListSequencesRequest{Model: "go-f16", PageSize: 1, PageToken: token}))
		check(len(r.Sequences) <= 1, "page_size 1 returned %d", len(r.Sequences))
		for _, q := range r.Sequences {
			ids = append(ids, string(q.SequenceId))
		}
		token = r.NextPageToken
		if len(token) == 0 {
			break
		}
	}
	sort.Strings(ids)
	eq(ids, []string{"go-layers", "go-seq"}, "ListSequences(go-f16) paged by 1")
	var all []string
	for _, q := range must(a.listSequences(&pb.ListSequencesRequest{})).Sequences {
		all = append(all, string(q.SequenceId))
	}
	check(contains(all, "go-prefix-dst") && contains(all, "go-seq"), "ListSequences() lacks sequences: %q", all)
	s.expectUnchanged("go-seq", errOf(a.deleteModel("go-f16", false)), codes.FailedPrecondition)
	must(a.deleteSequence("go-layers"))
	delete(s.refs, "go-layers")
	expectCode(errOf(a.stat("go-layers")), codes.NotFound)
	expectCode(errOf(a.read("go-layers", readOpts{})), codes.NotFound)
	s.verify("go-seq", "go-seq after deleting go-layers:")
	must(a.putModel(model("go-tmp", 1, 1, 0, 8, f16), false))
	must(s.create("go-tmp-1", "go-tmp", nil))
	must(s.create("go-tmp-2", "go-tmp", nil))
	must(a.append("go-tmp-1", bytes.Repeat([]byte{7}, 2*8*2*300), 0, 300, appendOpts{}))
	r := must(a.deleteModel("go-tmp", true))
	eq(r.DeletedSequences, uint64(2), "DeleteModel(force) deleted_sequences")
	expectCode(errOf(a.getModel("go-tmp")), codes.NotFound)
	expectCode(errOf(a.stat("go-tmp-1")), codes.NotFound)
	s.verify("go-seq", "go-seq after deleting model go-tmp:")
	// Names come back clean: a new model of another shape under the old name,
	// a sequence under the old id, and none of the old data.
	must(a.putModel(model("go-tmp", 2, 1, 0, 8, f16), false))
	ref := newReference(2, 1, 8, 2)
	info := must(s.create("go-tmp-1", "go-tmp", nil))
	eq(tuple(info.NumTokens, info.LayerTokens), tuple(0, []uint64{0, 0}), "re-created go-tmp-1")
	s.refs["go-tmp-1"] = ref
	s.appendRef("go-tmp-1", ref, 0, 2, 5, appendOpts{})
	s.verify("go-tmp-1", "go-tmp-1")
	delete(s.refs, "go-tmp-1")
	eq(must(a.deleteModel("go-tmp", true)).DeletedSequences, uint64(1), "DeleteModel(force) deleted_sequences")
}

// ---------------------------------------------------------------------------
// A large sequence, restart and shutdown

// A model the size of an 8B-class LLM (32 layers x 8 KV heads x 128, f16):
// 128 KiB of K+V per token; --large-mib MiB appended in one stream of 1 MiB
// messages and read back in 4 MiB chunks.
func (s *suite) tLarge() {
	a := s.api
	size := s.args.largeMib
	tokens := uint64(size * 8)
	total := size * mib
	must(a.putModel(model("go-large", 32, 8, 32, 128, f16), false))
	must(s.create("go-large", "go-large", nil))
	sent := sha256.New()
	header := appendMsgs([]byte("go-large"), nil, 0, tokens, appendOpts{})[0]
	left := total
	next := func() *pb.AppendRequest {
		if header != nil {
			h := header
			header = nil
			return h
		}
		if left == 0 {
			return nil
		}
		n := mib
		if left < n {
			n = left
		}
		left -= n
		piece := randomBytes(n)
		sent.Write(piece)
		return &pb.AppendRequest{Data: piece}
	}
	t0 := time.Now()
	r := must(a.appendNext(next, 600*time.Second))
	tAppend := time.Since(t0).Seconds()
	eq(r.BytesReceived, uint64(total), "large Append bytes_received")
	eq(r.Sequence.NumTokens, tokens, "large Append num_tokens")
	var d [32]byte
	copy(d[:], sent.Sum(nil))
	s.largeDigest = &d
	t0 = time.Now()
	s.readLarge(4 * mib)
	tRead := time.Since(t0).Seconds()
	// A Read cancelled after its first chunks leaves the server healthy.
	ctx, cancel := context.WithCancel(context.Background())
	st := must(a.kv.Read(ctx, &pb.ReadRequest{SequenceId: []byte("go-large")}))
	for i := 0; i < 3; i++ {
		if _, err := st.Recv(); err != nil {
			break
		}
	}
	cancel()
	eq(must(a.healthCheck("")).Status, healthpb.HealthCheckResponse_SERVING, "health after a cancelled Read")
	// max_chunk_bytes is capped at 4 MiB (or refused).
	if msg := try(func() { s.readLarge(64 * mib) }); msg != "" {
		check(strings.Contains(msg, "InvalidArgument"), "max_chunk_bytes 64 MiB: %s", msg)
	}
	fmt.Printf("     large: %d MiB, append %.0f MB/s, read %.0f MB/s (go client)\n", size,
		float64(total)/tAppend/1e6, float64(total)/tRead/1e6)
}

func (s *suite) readLarge(maxChunk uint32) {
	size := s.args.largeMib
	// Chunks beyond 4 MiB never come, whatever was asked.
	r := must(s.api.read("go-large", readOpts{maxChunk: maxChunk, hash: true, limit: 4 * mib,
		timeout: 600 * time.Second}))
	eq(tuple(r.header.NumLayers, r.header.NumTokens, r.header.TotalBytes), tuple(32, size*8, size*mib),
		"large read header")
	check(s.largeDigest != nil && r.digest == *s.largeDigest, "large sequence read back differs (sha256)")
}

func (s *suite) tRestart() {
	s.api.close()
	s.api = nil
	t0 := time.Now()
	rc := s.server.stop(30 * time.Second)
	t1 := time.Now()
	eq(rc, "0", "kvdepotd exit status on SIGTERM")
	s.connect()
	fmt.Printf("     stop %.2f s, start %.2f s\n", t1.Sub(t0).Seconds(), time.Since(t1).Seconds())
	var ids []string
	for id := range s.refs {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		s.verify(id, "after restart, "+id)
	}
	if s.largeDigest != nil {
		s.readLarge(4 * mib)
	}
	if s.args.largeOnly {
		return
	}
	// Deletions are as durable as writes.
	a := s.api
	for _, gone := range []string{"go-layers", "go-prefix-src", "go-tmp-1", "go-tmp-2"} {
		expectCode(errOf(a.stat(gone)), codes.NotFound)
	}
	expectCode(errOf(a.getModel("go-tmp")), codes.NotFound)
	names := must(a.listModels())
	for _, m := range []string{"go-f16", "go-prefix", "go-f32", "go-bf16"} {
		check(contains(names, m), "models after restart: %v", names)
	}
	if h := s.chain; h != nil {
		eq(s.lookup("go-prefix", h), tuple(3, 3*s.B), "Lookup after restart")
		// A new sequence from the persisted prefix holds the same bytes.
		s.refs["go-prefix-r"] = s.refs["go-prefix-dst"].clonePrefix(len(h) * s.B)
		must(a.create(&pb.CreateSequenceRequest{SequenceId: []byte("go-prefix-r"),
			Model: "go-prefix", PrefixHashes: h}))
		s.verify("go-prefix-r", "sequence from the prefix after restart:")
	}
}

func (s *suite) tShutdown() {
	s.api.close()
	s.api = nil
	eq(s.server.stop(30*time.Second), "0", "kvdepotd exit status on SIGTERM")
}

// ---------------------------------------------------------------------------

func (s *suite) main() {
	if s.args.securityOnly {
		s.run("tls, mtls and tokens", s.tSecurity)
		return
	}
	if msg := try(s.connect); msg != "" {
		s.failed++
		fmt.Printf("FAIL %-28s %s\n", "start kvdepotd", msg)
		return
	}
	large := fmt.Sprintf("large %d MiB", s.args.largeMib)
	checks := []struct {
		name string
		fn   func()
	}{
		{"health", s.tHealth},
		{"models", s.tModels},
		{"model errors", s.tModelErrors},
		{"append/read round trip", s.tRoundtrip},
		{"append layer by layer", s.tLayerwise},
		{"f32, bf16, binary ids", s.tDtypes},
		{"unknown ids", s.tErrorsUnknown},
		{"create errors", s.tErrorsCreate},
		{"append errors", s.tErrorsAppend},
		{"read errors", s.tErrorsRead},
		{"header reserves no memory", s.tHeaderMemory},
		{"limits and overflow", s.tErrorsLimits},
		{"garbage messages", s.tErrorsGarbage},
		{"names byte for byte", s.tNames},
		{"append atomicity", s.tAppendAtomic},
		{"cancelled append", s.tCancelledAppend},
		{"prefix hash and lookup", s.tPrefix},
		{"prefix chains, per layer", s.tPrefixMore},
		{"engine-supplied hashes", s.tEngineHashes},
		{"list and delete", s.tListDelete},
		{"concurrent clients", s.tConcurrent},
		{"deletes racing reads/appends", s.tDeleteRaces},
		{large, s.tLarge},
		{"compute: attend, search, sparse attend, plan", s.tCompute},
		{"append pages", s.tAppendPages},
		{"activations (KVPR)", s.tActivations},
		{"calibrate and artifacts", s.tCalibrate},
		{"codecs: VQ and SVD", s.tCodecsVqSvd},
		{"restart", s.tRestart},
		{"shutdown", s.tShutdown},
	}
	keep := map[string]bool{"health": true, large: true, "restart": true, "shutdown": true}
	for _, c := range checks {
		if s.args.largeOnly && !keep[c.name] {
			continue
		}
		if !s.server.alive() && c.name != "restart" {
			s.failed++
			fmt.Printf("FAIL %-28s kvdepotd is not running\n", c.name)
			continue
		}
		s.run(c.name, c.fn)
	}
}

func (s *suite) cleanup() {
	if s.api != nil {
		s.api.close()
	}
	s.server.kill()
	if s.args.keep {
		fmt.Printf("%s: kept %s\n", prefix, s.workdir)
	} else {
		os.RemoveAll(s.workdir)
	}
}
