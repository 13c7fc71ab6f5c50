package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"math"
	"math/rand"

	"google.golang.org/grpc/codes"

	pb "kvdinterop/kvdepot/v1"
)

// Activations (KVPR), calibration and artifacts, VQ and SVD sequences.

func (a *api) calibrate(msgs []*pb.CalibrateRequest) (*pb.CalibrateResponse, error) {
	return sendStream(callTimeout, func(ctx context.Context) (clientStream[pb.CalibrateRequest, pb.CalibrateResponse], error) {
		return a.kv.Calibrate(ctx)
	}, sliceNext(msgs))
}

func (a *api) artifacts(model string) ([]*pb.Artifact, error) {
	msgs, err := recvAll(func(ctx context.Context) (interface {
		Recv() (*pb.GetArtifactsResponse, error)
	}, error) {
		return a.kv.GetArtifacts(ctx, &pb.GetArtifactsRequest{Model: model})
	})
	var out []*pb.Artifact
	for _, m := range msgs {
		out = append(out, m.Artifact)
	}
	return out, err
}

func (a *api) upload(model string, arts []*pb.Artifact) (*pb.UploadArtifactsResponse, error) {
	return sendStream(callTimeout, func(ctx context.Context) (clientStream[pb.UploadArtifactsRequest, pb.UploadArtifactsResponse], error) {
		return a.kv.UploadArtifacts(ctx)
	}, sliceNext([]*pb.UploadArtifactsRequest{{Model: model, Artifacts: arts}}))
}

// Append with_activations stores X; a Read with activation_tokens l (l from
// PlanFetch) streams X of [t0, t0 + l) then K/V of the rest, equal to what was
// appended; errors change nothing.
func (s *suite) tActivations() {
	a := s.api
	const L, HKV, D, HID, n = 2, 2, 8, 16, 300
	m := model("go-act", L, HKV, 0, D, f16)
	m.HiddenSize = HID
	must(a.putModel(m, false))
	store := &pb.SequenceCodecs{StoreActivations: true}
	must(s.create("go-act", "go-act", store))
	must(s.create("go-act-plain", "go-act", nil))
	kvTok, xTok := HKV*D*2, HID*2
	var k, v, x [L][]byte
	for l := 0; l < L; l++ {
		k[l], v[l], x[l] = randomBytes(n*kvTok), randomBytes(n*kvTok), randomBytes(n*xTok)
	}
	sl := func(parts [L][]byte, tb, t0, t1 int) []byte {
		var out []byte
		for _, p := range parts {
			out = append(out, p[t0*tb:t1*tb]...)
		}
		return out
	}
	appendX := func(id string, t0, nt int, withX bool) error {
		data := append(sl(k, kvTok, t0, t0+nt), sl(v, kvTok, t0, t0+nt)...)
		if withX {
			data = append(data, sl(x, xTok, t0, t0+nt)...)
		}
		return errOf(a.appendStream(appendMsgs([]byte(id), data, uint64(t0), uint64(nt),
			appendOpts{chunk: 7000, withActivations: withX})))
	}
	readX := func(req *pb.ReadRequest) (*pb.ReadHeader, []byte, error) {
		if req.SequenceId == nil {
			req.SequenceId = []byte("go-act")
		}
		req.MaxChunkBytes = 4096
		msgs, err := a.readAll(req)
		if err != nil {
			return nil, nil, err
		}
		var data []byte
		for _, m := range msgs {
			data = append(data, m.Data...)
		}
		return msgs[0].Header, data, nil
	}

	if err := appendX("go-act", 0, 256, true); err != nil {
		failErr(err)
	}
	if err := appendX("go-act", 256, 44, true); err != nil {
		failErr(err)
	}
	eq(must(a.stat("go-act")).ActivationTokens, uint64(n), "activation_tokens")
	p := must(a.planFetch(&pb.PlanFetchRequest{SequenceId: []byte("go-act"),
		BandwidthBytesPerS: 1e9, ComputeFlopsPerS: 1e11}))
	l0 := int(p.SplitTokens)
	check(l0 > 0 && l0 <= n, "PlanFetch split %d with %d stored activations", l0, n)
	for _, c := range [][3]int{{0, n, l0}, {0, n, n}, {5, 290, 251}, {299, 1, 1}} {
		t0, nt, l := c[0], c[1], c[2]
		h, data, err := readX(&pb.ReadRequest{TokenStart: uint64(t0), NumTokens: uint64(nt),
			ActivationTokens: uint64(l)})
		if err != nil {
			failErr(err)
		}
		eq(tuple(h.ActivationTokens, h.HiddenSize, h.ActivationBytes), tuple(l, HID, L*l*xTok),
			"activation-first Read header")
		eq(uint64(len(data)), h.ActivationBytes+h.TotalBytes, "activation-first Read bytes")
		want := append(append(sl(x, xTok, t0, t0+l), sl(k, kvTok, t0+l, t0+nt)...),
			sl(v, kvTok, t0+l, t0+nt)...)
		check(bytes.Equal(data, want), "activation-first Read t0=%d n=%d l=%d differs", t0, nt, l)
		if l < nt {
			plain := must(a.read("go-act", readOpts{tokenStart: uint64(t0 + l), numTokens: uint64(nt - l)}))
			check(bytes.Equal(data[L*l*xTok:], plain.data),
				"K/V part differs from a plain Read of the remaining tokens")
		}
	}
	// Errors: clear status, nothing stored.
	expectCode(appendX("go-act-plain", 0, 10, true), codes.FailedPrecondition)
	eq(must(a.stat("go-act-plain")).NumTokens, uint64(0), "plain sequence after refused X")
	expectCode(errOf2(readX(&pb.ReadRequest{ActivationTokens: n + 1})), codes.InvalidArgument)
	expectCode(errOf2(readX(&pb.ReadRequest{ActivationTokens: 1,
		Format: pb.ReadFormat_READ_FORMAT_PAGES})), codes.InvalidArgument)
	// A gap: 10 tokens with X, 5 without; X can no longer follow, and a Read
	// cannot ask for X past the 10.
	must(s.create("go-act2", "go-act", store))
	if err := appendX("go-act2", 0, 10, true); err != nil {
		failErr(err)
	}
	if err := appendX("go-act2", 10, 5, false); err != nil {
		failErr(err)
	}
	expectCode(appendX("go-act2", 15, 5, true), codes.FailedPrecondition)
	s2 := must(a.stat("go-act2"))
	eq(tuple(s2.NumTokens, s2.ActivationTokens), tuple(15, 10), "tokens, activation_tokens after a gap")
	expectCode(errOf2(readX(&pb.ReadRequest{SequenceId: []byte("go-act2"), ActivationTokens: 11})),
		codes.OutOfRange)
	// Deleting the sequence takes its activations along.
	must(a.deleteSequence("go-act"))
	must(s.create("go-act", "go-act", store))
	eq(must(a.stat("go-act")).ActivationTokens, uint64(0), "activation_tokens after re-create")
}

// Calibrate, UploadArtifacts and GetArtifacts: smoothing factors against
// their definition computed here, rotations orthonormal, codebook shapes, a
// bit-exact upload round trip, and errors that change nothing.
func (s *suite) tCalibrate() {
	a := s.api
	const L, HKV, HQ, D, n = 1, 2, 4, 16, 200
	must(a.putModel(model("go-cal", L, HKV, HQ, D, f32), false))
	r := rand.New(rand.NewSource(777))
	k := uniform(r, n*HKV*D, 2)
	v := uniform(r, n*HKV*D, 1)
	q := uniform(r, n*HQ*D, 1)
	kb := f32s(k)
	type calOpts struct {
		model string
		layer uint32
		k     []byte
	}
	calibrate := func(o calOpts) (*pb.CalibrateResponse, error) {
		if o.model == "" {
			o.model = "go-cal"
		}
		if o.k == nil {
			o.k = kb
		}
		return a.calibrate([]*pb.CalibrateRequest{
			{Header: &pb.CalibrateHeader{Model: o.model, Svd: true, Seed: 4,
				Vq: &pb.VQSpec{SubDim: 4, Bits: 5}}},
			{Sample: &pb.CalibrateSample{Layer: o.layer, NumTokens: n, K: o.k, V: f32s(v), Q: f32s(q)}},
		})
	}

	res := must(calibrate(calOpts{}))
	eq(res.Samples, uint64(n), "Calibrate samples")
	eq(res.Artifacts, uint32(HKV*7), "artifacts written")
	eq(len(res.Errors), HKV, "error rows")
	for _, e := range res.Errors {
		check(e.VqK > 0 && e.VqK < 1 && e.VqV > 0 && e.VqV < 1, "VQ errors %v %v", e.VqK, e.VqV)
		check(e.SvdWidthK >= 1 && e.SvdWidthK <= D && e.SvdK >= 0 && e.SvdK <= 0.1,
			"SVD width/error of K: %d %v", e.SvdWidthK, e.SvdK)
	}
	arts := must(a.artifacts("go-cal"))
	eq(len(arts), HKV*7, "artifacts stored")
	for _, art := range arts {
		vals := readF32s(art.Data)
		switch art.Kind {
		case pb.ArtifactKind_ARTIFACT_KEY_SMOOTHING: // lambda_i = sqrt(max_t |k_ti|)
			eq(len(vals), D, "smoothing factors")
			for i := 0; i < D; i++ {
				mx := 0.0
				for t := 0; t < n; t++ {
					mx = math.Max(mx, math.Abs(float64(k[(t*HKV+int(art.KvHead))*D+i])))
				}
				check(math.Abs(float64(vals[i])-math.Sqrt(mx)) <= 1e-6*math.Sqrt(mx),
					"lambda[%d] of head %d: %v vs %v", i, art.KvHead, vals[i], math.Sqrt(mx))
			}
		case pb.ArtifactKind_ARTIFACT_SVD_ROTATION_K, pb.ArtifactKind_ARTIFACT_SVD_ROTATION_V:
			eq(art.Shape, []uint32{D, D}, "rotation shape")
			for i := 0; i < D; i++ {
				for j := 0; j < D; j++ {
					dot := 0.0
					for row := 0; row < D; row++ {
						dot += float64(vals[row*D+i]) * float64(vals[row*D+j])
					}
					want := 0.0
					if i == j {
						want = 1
					}
					check(math.Abs(dot-want) < 1e-4, "rotation not orthonormal")
				}
			}
		case pb.ArtifactKind_ARTIFACT_VQ_CODEBOOK_K, pb.ArtifactKind_ARTIFACT_VQ_CODEBOOK_V:
			eq(art.Shape, []uint32{32, 4}, "codebook shape")
		}
	}
	// A replacement uploaded and read back bit-exact (odd bit patterns too).
	lv := make([]float32, D)
	for i := 0; i < D-1; i++ {
		lv[i] = float32(i) + 0.1
	}
	lv[D-1] = 1e-30
	lam := f32s(lv)
	smoothing := pb.ArtifactKind_ARTIFACT_KEY_SMOOTHING
	eq(must(a.upload("go-cal", []*pb.Artifact{{Kind: smoothing, Layer: 0, KvHead: 1,
		Shape: []uint32{D}, Data: lam}})).Artifacts, uint32(1), "uploaded")
	var got []*pb.Artifact
	for _, art := range must(a.artifacts("go-cal")) {
		if art.Kind == smoothing && art.KvHead == 1 {
			got = append(got, art)
		}
	}
	eq(len(got), 1, "one smoothing artifact for head 1")
	check(bytes.Equal(got[0].Data, lam), "uploaded artifact bytes differ")
	// Errors: nothing changes.
	digest := func() []string {
		var out []string
		for _, art := range must(a.artifacts("go-cal")) {
			out = append(out, hex.EncodeToString(art.Data))
		}
		return out
	}
	before := digest()
	expectCode(errOf(calibrate(calOpts{k: kb[:len(kb)-4]})), codes.InvalidArgument)
	expectCode(errOf(calibrate(calOpts{layer: L})), codes.InvalidArgument)
	expectCode(errOf(calibrate(calOpts{model: "go-nosuch"})), codes.NotFound)
	expectCode(errOf(a.upload("go-cal", []*pb.Artifact{{Kind: pb.ArtifactKind_ARTIFACT_SVD_ROTATION_K,
		Shape: []uint32{D, 8}, Data: make([]byte, 4*D*8)}})), codes.InvalidArgument)
	expectCode(errOf(a.upload("go-cal", []*pb.Artifact{{Kind: smoothing, Shape: []uint32{D},
		Data: lam[:len(lam)-4]}})), codes.InvalidArgument)
	eq(digest(), before, "artifacts after errors")
}

// VQ and SVD-reduced sequences: FAILED_PRECONDITION before the model is
// calibrated (nothing created), then pages seal coded (page codec 3 VQ, 4
// SVD) and Attend equals attention computed here on the tensors read back; a
// VQ shape that was not calibrated is refused.
func (s *suite) tCodecsVqSvd() {
	a := s.api
	const HKV, HQ, D, n = 2, 4, 16, 300
	must(a.putModel(model("go-vq", 1, HKV, HQ, D, f32), false))
	r := rand.New(rand.NewSource(4242))
	vq := &pb.CodecSpec{Codec: pb.Codec_CODEC_VQ, Vq: &pb.VQSpec{SubDim: 4, Bits: 5}}
	svd := &pb.CodecSpec{Codec: pb.Codec_CODEC_RAW, Svd: &pb.SVDSpec{RemovalRate: 0.3, Align: 2}}
	expectCode(errOf(s.create("go-vq", "go-vq", &pb.SequenceCodecs{K: vq, V: vq})), codes.FailedPrecondition)
	expectCode(errOf(s.create("go-svd", "go-vq", &pb.SequenceCodecs{K: svd, V: svd})), codes.FailedPrecondition)
	expectCode(errOf(a.stat("go-vq")), codes.NotFound)
	must(a.calibrate([]*pb.CalibrateRequest{
		{Header: &pb.CalibrateHeader{Model: "go-vq", Svd: true, Seed: 3, Vq: &pb.VQSpec{SubDim: 4, Bits: 5}}},
		{Sample: &pb.CalibrateSample{Layer: 0, NumTokens: n, K: f32s(uniform(r, n*HKV*D, 1)),
			V: f32s(uniform(r, n*HKV*D, 1)), Q: f32s(uniform(r, n*HQ*D, 1))}},
	}))
	expectCode(errOf(s.create("go-vq", "go-vq", &pb.SequenceCodecs{K: &pb.CodecSpec{
		Codec: pb.Codec_CODEC_VQ, Vq: &pb.VQSpec{SubDim: 3, Bits: 5}}})), codes.InvalidArgument)
	expectCode(errOf(s.create("go-vq", "go-vq", &pb.SequenceCodecs{K: &pb.CodecSpec{
		Codec: pb.Codec_CODEC_VQ, Vq: &pb.VQSpec{SubDim: 4, Bits: 8}}})), codes.FailedPrecondition)
	expectCode(errOf(a.stat("go-vq")), codes.NotFound)
	// a reduction that keeps all 16 dimensions of every head (flat spectrum,
	// widths rounded up to the default multiple of 8) is refused
	noop := &pb.CodecSpec{Codec: pb.Codec_CODEC_RAW, Svd: &pb.SVDSpec{RemovalRate: 0.2}}
	expectCode(errOf(s.create("go-noop", "go-vq", &pb.SequenceCodecs{K: noop})), codes.InvalidArgument)
	expectCode(errOf(a.stat("go-noop")), codes.NotFound)
	data := f32s(uniform(r, 2*n*HKV*D, 1))
	q := uniform(r, HQ*D, 1)
	for _, c := range []struct {
		sid    string
		codecs *pb.SequenceCodecs
		want   byte
	}{{"go-vq", &pb.SequenceCodecs{K: vq, V: vq}, 3}, {"go-svd", &pb.SequenceCodecs{K: svd, V: svd}, 4}} {
		must(s.create(c.sid, "go-vq", c.codecs))
		must(a.append(c.sid, data, 0, n, appendOpts{dtype: f32}))
		back := must(a.read(c.sid, readOpts{})).data
		kb, vb := rowsF32(back, n, HKV*D)
		res := must(a.attend(&pb.AttendRequest{Layer: 0, Queries: []*pb.AttendQuery{{
			SequenceId: []byte(c.sid), Q: q}}}))
		out, lse := attention(q, kb, vb, HQ, HKV, D, 1/math.Sqrt(D), nil)
		checkAttend(c.sid+" Attend", res.Results[0], out, lse, 1e-4, 1e-4)
		pages := s.storedPages(c.sid)
		check(len(pages) >= 2, "%s: %d stored pages", c.sid, len(pages))
		eq(tuple(pages[0][8], pages[0][9], pages[len(pages)-1][8]), tuple(c.want, c.want, 0),
			c.sid+" stored page codecs (sealed, tail)")
	}
}
