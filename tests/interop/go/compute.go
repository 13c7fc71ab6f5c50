package main

import (
	"bytes"
	"context"
	"math"
	"math/rand"

	"github.com/golang/protobuf/proto"
	"google.golang.org/grpc/codes"

	pb "kvdinterop/kvdepot/v1"
)

// Compressed caches, compute calls and client-encoded pages from gRPC-Go.

func int4Spec() *pb.CodecSpec {
	return &pb.CodecSpec{Codec: pb.Codec_CODEC_INT4, Quant: &pb.QuantSpec{GroupSize: 32}}
}

func int2Spec() *pb.CodecSpec {
	return &pb.CodecSpec{Codec: pb.Codec_CODEC_INT2, Quant: &pb.QuantSpec{GroupSize: 32}}
}

// Attend (raw and INT4) against attention computed here on the tensors read
// back; Search and SparseAttend on a PQ-indexed sequence; Read in page format;
// PlanFetch against a brute-force minimisation; and their errors.
func (s *suite) tCompute() {
	a := s.api
	const L, HKV, HQ, D, n = 1, 2, 4, 32, 200
	m := model("go-compute", L, HKV, HQ, D, f32)
	m.HiddenSize = 32
	must(a.putModel(m, false))
	r := rand.New(rand.NewSource(12345))
	rows := uniform(r, n*HKV*D, 1)
	vrows := uniform(r, n*HKV*D, 1)
	buf := f32s(append(append([]float32(nil), rows...), vrows...))
	q := uniform(r, HQ*D, 1)
	scale := 1 / math.Sqrt(D)
	for _, c := range []struct {
		sid    string
		codecs *pb.SequenceCodecs
	}{{"go-raw", nil}, {"go-int4", &pb.SequenceCodecs{K: int4Spec(), V: int4Spec()}}} {
		must(s.create(c.sid, "go-compute", c.codecs))
		must(a.append(c.sid, buf, 0, n, appendOpts{dtype: f32}))
		data := must(a.read(c.sid, readOpts{})).data
		kb, vb := rowsF32(data, n, HKV*D)
		if c.codecs == nil {
			check(bytes.Equal(data, buf), "raw read-back differs")
		}
		for _, rg := range [][2]int{{0, 0}, {7, 150}} {
			t0, cnt := rg[0], rg[1]
			res := must(a.attend(&pb.AttendRequest{Layer: 0, Queries: []*pb.AttendQuery{{
				SequenceId: []byte(c.sid), Q: q, TokenStart: uint64(t0), NumTokens: uint64(cnt)}}}))
			eq(len(res.Results), 1, "Attend results")
			got := res.Results[0]
			if cnt == 0 {
				cnt = n - t0
			}
			eq(got.NumTokens, uint64(cnt), "Attend num_tokens")
			out, lse := attention(q, kb[t0:t0+cnt], vb[t0:t0+cnt], HQ, HKV, D, scale, nil)
			tol := 1e-4
			if c.codecs != nil {
				tol = 3e-2
			}
			checkAttend(c.sid+" Attend", got, out, lse, tol, 1e-3)
		}
	}

	// Search + SparseAttend on a PQ-indexed (raw K/V) sequence: SparseAttend
	// attends over exactly the tokens Search picks, and equals attention over
	// them computed here.
	must(s.create("go-pq", "go-compute", &pb.SequenceCodecs{Pq: &pb.PQSpec{M: 4, Bits: 4}}))
	must(a.append("go-pq", buf, 0, n, appendOpts{dtype: f32}))
	sreq := &pb.SearchRequest{SequenceId: []byte("go-pq"), Layer: 0, Q: q, K: 20,
		InitialTokens: 2, RecentTokens: 5}
	sr := must(a.search(sreq))
	eq(len(sr.Heads), HKV, "Search heads")
	var picked [][]int
	for _, hd := range sr.Heads {
		eq(len(hd.Tokens), 27, "Search tokens per head (k + initial + recent)")
		got := map[uint64]bool{}
		var ts []int
		for _, t := range hd.Tokens {
			got[t] = true
			ts = append(ts, int(t))
		}
		for _, t := range []uint64{0, 1, n - 5, n - 1} {
			check(got[t], "Search: forced token %d missing", t)
		}
		eq(len(got), 27, "Search tokens distinct")
		for i := 1; i < len(hd.Scores); i++ {
			check(hd.Scores[i-1] >= hd.Scores[i], "Search scores not ordered")
		}
		picked = append(picked, ts)
	}
	sa := must(a.sparseAttend(&pb.SparseAttendRequest{Search: sreq}))
	eq(len(sa.Heads), HKV, "SparseAttend heads")
	for h, hd := range sa.Heads {
		eq(hd.Tokens, sr.Heads[h].Tokens, "SparseAttend tokens vs Search")
	}
	k, v := rowsF32(buf, n, HKV*D)
	out, lse := attention(q, k, v, HQ, HKV, D, scale, picked)
	checkAttend("SparseAttend", sa.Result, out, lse, 1e-4, 1e-3)
	with := func(f func(*pb.SearchRequest)) *pb.SearchRequest {
		c := proto.Clone(sreq).(*pb.SearchRequest)
		f(c)
		return c
	}
	expectCode(errOf(a.search(with(func(c *pb.SearchRequest) { c.K = n + 1 }))), codes.InvalidArgument)
	expectCode(errOf(a.sparseAttend(&pb.SparseAttendRequest{
		Search: with(func(c *pb.SearchRequest) { c.Q = q[:D] })})), codes.InvalidArgument)
	expectCode(errOf(a.search(with(func(c *pb.SearchRequest) { c.SequenceId = []byte("go-raw") }))),
		codes.FailedPrecondition)
	expectCode(errOf(a.sparseAttend(&pb.SparseAttendRequest{
		Search: with(func(c *pb.SearchRequest) { c.SequenceId = []byte("go-none") })})), codes.NotFound)
	eq(must(a.stat("go-pq")).NumTokens, uint64(n), "go-pq after errors")

	// Read in page format: one stored page per message, every page holding a
	// token of the range; sealed pages INT2, the tail raw and equal to what
	// was appended (its K section is head-major).
	info := must(s.create("go-pages", "go-compute", &pb.SequenceCodecs{K: int2Spec()}))
	B := int(info.PageTokens)
	n2 := B + 40
	pbuf := f32s(uniform(r, 2*n2*HKV*D, 1))
	must(a.append("go-pages", pbuf, 0, uint64(n2), appendOpts{dtype: f32}))
	readPages := func(req *pb.ReadRequest) ([]*pb.ReadResponse, error) {
		req.SequenceId = []byte("go-pages")
		req.Format = pb.ReadFormat_READ_FORMAT_PAGES
		return a.readAll(req)
	}
	msgs := must(readPages(&pb.ReadRequest{TokenStart: 3, NumTokens: uint64(B + 1)}))
	check(len(msgs) > 0 && msgs[0].Header != nil, "Read pages: no header")
	eq(msgs[0].Header.Format, pb.ReadFormat_READ_FORMAT_PAGES, "Read pages: header format")
	eq(len(msgs), 3, "Read pages: header + page count")
	for b, m := range msgs[1:] {
		pg := m.Data
		check(len(pg) >= 64, "Read pages: page %d of %d bytes", b, len(pg))
		eq(string(pg[:4]), "KVDP", "Read pages: magic")
		ntok := B
		if b == 1 {
			ntok = n2 - B
		}
		eq(tuple(getU32(pg[12:]), getU64(pg[16:]), getU32(pg[24:]), getU32(pg[28:])),
			tuple(0, b*B, ntok, B), "Read pages: page header")
		eq(int(pg[8]), 1-b, "Read pages: K codec")
		check(getU64(pg[56:]) == pageChecksum(pg), "Read pages: page %d checksum", b)
	}
	tail := msgs[2].Data
	koff := int(getU64(tail[64+8:]))
	for h := 0; h < HKV; h++ {
		for t := 0; t < n2-B; t++ {
			got := tail[koff+(h*(n2-B)+t)*D*4 : koff+(h*(n2-B)+t+1)*D*4]
			want := pbuf[((B+t)*HKV+h)*D*4 : ((B+t)*HKV+h+1)*D*4]
			check(bytes.Equal(got, want), "Read pages: tail K of token %d head %d", B+t, h)
		}
	}
	expectCode(errOf(readPages(&pb.ReadRequest{ActivationTokens: 1})), codes.InvalidArgument)
	expectCode(errOf(readPages(&pb.ReadRequest{TokenStart: uint64(n2), NumTokens: 1})), codes.OutOfRange)

	for _, c := range [][2]float64{{1e6, 1e12}, {1e9, 1e9}} {
		bw, fl := c[0], c[1]
		p := must(a.planFetch(&pb.PlanFetchRequest{SequenceId: []byte("go-raw"),
			BandwidthBytesPerS: bw, ComputeFlopsPerS: fl, AssumeActivations: true}))
		t := func(l float64) float64 {
			return l*p.ActivationBytesPerToken/bw +
				math.Max(l*p.FlopsPerToken/fl, (n-l)*p.KvBytesPerToken/bw)
		}
		best := math.Inf(1)
		for l := 0; l <= n; l++ {
			best = math.Min(best, t(float64(l)))
		}
		check(t(float64(p.SplitTokens)) <= best*(1+1e-9), "PlanFetch split %d not minimal",
			p.SplitTokens)
	}
	bad := &pb.CodecSpec{Codec: pb.Codec_CODEC_INT2, Quant: &pb.QuantSpec{GroupSize: 48}}
	expectCode(errOf(s.create("go-bad", "go-compute", &pb.SequenceCodecs{K: bad})), codes.InvalidArgument)
	expectCode(errOf(a.stat("go-bad")), codes.NotFound)
	expectCode(errOf(a.attend(&pb.AttendRequest{Queries: []*pb.AttendQuery{{
		SequenceId: []byte("go-none"), Q: q}}})), codes.NotFound)
	expectCode(errOf(a.attend(&pb.AttendRequest{Queries: []*pb.AttendQuery{{
		SequenceId: []byte("go-raw"), Q: q[:D]}}})), codes.InvalidArgument)
}

// ---------------------------------------------------------------------------
// AppendPages

func (a *api) appendPages(msgs []*pb.AppendPagesRequest) (*pb.AppendPagesResponse, error) {
	return sendStream(callTimeout, func(ctx context.Context) (clientStream[pb.AppendPagesRequest, pb.AppendPagesResponse], error) {
		return a.kv.AppendPages(ctx)
	}, sliceNext(msgs))
}

// rawPage encodes tokens [t0, t0+nt) of one layer as a raw page, from the
// format's definition (docs/page-format.md): K and V wire rows
// ([token][head][dim], esize bytes a value) become head-major sections.
func rawPage(layer, t0, nt, pageTokens, hkv, d int, dtype pb.DType, esize int, k, v []byte) []byte {
	const hdr = 64 + 2*24
	sec := hkv * nt * d * esize
	p := make([]byte, hdr+2*sec)
	copy(p, "KVDP")
	putU16(p[4:], 1)
	putU16(p[6:], hdr)
	p[10] = byte(dtype)
	if nt == pageTokens {
		p[11] = 1 // sealed
	}
	putU32(p[12:], uint32(layer))
	putU64(p[16:], uint64(t0))
	putU32(p[24:], uint32(nt))
	putU32(p[28:], uint32(pageTokens))
	putU32(p[32:], uint32(hkv))
	putU32(p[36:], uint32(d))
	putU16(p[48:], 2)
	for i, rows := range [][]byte{k, v} {
		e := p[64+24*i:]
		putU16(e, uint16(i+1)) // 1 K, 2 V
		off := hdr + i*sec
		putU64(e[8:], uint64(off))
		putU64(e[16:], uint64(sec))
		row := d * esize
		for t := 0; t < nt; t++ {
			for h := 0; h < hkv; h++ {
				src := rows[((t0+t)*hkv+h)*row : ((t0+t)*hkv+h+1)*row]
				copy(p[off+(h*nt+t)*row:], src)
			}
		}
	}
	putU64(p[56:], pageChecksum(p))
	return p
}

func pagesMsgs(id string, groups ...[][]byte) []*pb.AppendPagesRequest {
	msgs := []*pb.AppendPagesRequest{{Header: &pb.AppendPagesHeader{SequenceId: []byte(id)}}}
	for _, g := range groups {
		msgs = append(msgs, &pb.AppendPagesRequest{Pages: g})
	}
	return msgs
}

// storedPages reads every stored page of a sequence (page format).
func (s *suite) storedPages(id string) [][]byte {
	msgs := must(s.api.readAll(&pb.ReadRequest{SequenceId: []byte(id),
		Format: pb.ReadFormat_READ_FORMAT_PAGES}))
	var out [][]byte
	for _, m := range msgs[1:] {
		out = append(out, m.Data)
	}
	return out
}

// Pages encoded here from the format's definition are taken, stored as sent
// and read back decoded; INT2/INT4 pages read from one sequence and sent to
// another give the same tensors and the same attention; every bad page or
// tiling is refused with its status and changes nothing.
func (s *suite) tAppendPages() {
	a := s.api
	const L, HKV, HQ, D = 2, 2, 4, 32
	B := s.B
	check(B > 0, "needs the page size from the round trip check")
	must(a.putModel(model("go-pg", L, HKV, HQ, D, f32), false))
	r := rand.New(rand.NewSource(99))
	n := 2*B + 40
	ref := newReference(L, HKV, D, 4)
	for l := 0; l < L; l++ {
		ref.k[l] = f32s(uniform(r, n*HKV*D, 1))
		ref.v[l] = f32s(uniform(r, n*HKV*D, 1))
	}
	page := func(l, t0, nt int) []byte {
		return rawPage(l, t0, nt, B, HKV, D, f32, 4, ref.k[l], ref.v[l])
	}

	// Raw pages built here: block 0 sealed and a 40-token tail per layer.
	must(s.create("go-pg-raw", "go-pg", nil))
	sent := [][]byte{page(0, 0, B), page(0, B, 40), page(1, 0, B), page(1, B, 40)}
	total := 0
	for _, p := range sent {
		total += len(p)
	}
	resp := must(a.appendPages(pagesMsgs("go-pg-raw", sent[:2], sent[2:])))
	eq(tuple(resp.PagesReceived, resp.BytesReceived), tuple(4, total), "AppendPages counts")
	eq(resp.Sequence.LayerTokens, []uint64{uint64(B + 40), uint64(B + 40)}, "layer_tokens after AppendPages")
	s.refs["go-pg-raw"] = ref.clonePrefix(B + 40)
	s.verify("go-pg-raw", "go-pg-raw")
	stored := s.storedPages("go-pg-raw")
	eq(len(stored), 4, "pages stored")
	for i := range sent {
		check(bytes.Equal(stored[i], sent[i]), "stored page %d differs from the page sent", i)
	}
	// A fragment completing block 1 on each layer: the server seals it.
	must(a.appendPages(pagesMsgs("go-pg-raw", [][]byte{page(0, B+40, B-40), page(1, B+40, B-40)})))
	s.refs["go-pg-raw"] = ref.clonePrefix(2 * B)
	s.verify("go-pg-raw", "go-pg-raw")
	eq(must(a.stat("go-pg-raw")).SealedPages, uint64(2*L), "sealed_pages after the fragment")
	q := uniform(r, HQ*D, 1)
	kb, vb := rowsF32(ref.wire(1, 1, 0, 2*B), 2*B, HKV*D)
	out, lse := attention(q, kb, vb, HQ, HKV, D, 1/math.Sqrt(D), nil)
	res := must(a.attend(&pb.AttendRequest{Layer: 1, Queries: []*pb.AttendQuery{{
		SequenceId: []byte("go-pg-raw"), Q: q}}}))
	checkAttend("go-pg-raw Attend", res.Results[0], out, lse, 1e-4, 1e-4)

	// Coded pages carried from one sequence to another.
	codecs := &pb.SequenceCodecs{K: int2Spec(), V: int4Spec()}
	must(s.create("go-pg-src", "go-pg", codecs))
	must(a.append("go-pg-src", ref.wire(0, L, 0, n), 0, uint64(n), appendOpts{dtype: f32}))
	pages := s.storedPages("go-pg-src")
	eq(len(pages), 3*L, "coded source pages")
	eq(tuple(pages[0][8], pages[0][9], pages[2][8]), tuple(1, 2, 0), "source page codecs (sealed, tail)")
	must(s.create("go-pg-dst", "go-pg", codecs))
	must(a.appendPages(pagesMsgs("go-pg-dst", pages)))
	srcData := must(a.read("go-pg-src", readOpts{})).data
	same := func(what string) {
		eq(must(a.stat("go-pg-dst")).LayerTokens, []uint64{uint64(n), uint64(n)}, what+" layer_tokens")
		check(bytes.Equal(must(a.read("go-pg-dst", readOpts{})).data, srcData),
			"%s: decoded tensors differ from the source sequence's", what)
	}
	same("go-pg-dst")
	for i, p := range s.storedPages("go-pg-dst") {
		check(bytes.Equal(p, pages[i]), "go-pg-dst page %d differs from the page sent", i)
	}
	att := func(id string) *pb.AttendResult {
		return must(a.attend(&pb.AttendRequest{Layer: 0, Queries: []*pb.AttendQuery{{
			SequenceId: []byte(id), Q: q}}})).Results[0]
	}
	as, ad := att("go-pg-src"), att("go-pg-dst")
	eq(ad.Output, as.Output, "Attend output of the copied pages")
	eq(ad.Lse, as.Lse, "Attend lse of the copied pages")

	// Errors: a fresh sequence stays empty, the copy stays as it is.
	must(s.create("go-pg-err", "go-pg", codecs))
	empty := func(what string) {
		eq(must(a.stat("go-pg-err")).LayerTokens, []uint64{0, 0}, what+": go-pg-err layer_tokens")
		same(what)
	}
	flipped := append([]byte(nil), pages[0]...)
	flipped[len(flipped)/2] ^= 0x10
	badSum := append([]byte(nil), pages[0]...)
	badSum[57] ^= 1
	narrow := rawPage(0, 0, 40, B, HKV, D/2, f32, 4, ref.k[0], ref.v[0])
	cases := []struct {
		what string
		msgs []*pb.AppendPagesRequest
		want []codes.Code
	}{
		{"a flipped payload byte", pagesMsgs("go-pg-err", [][]byte{flipped}), []codes.Code{codes.DataLoss}},
		{"a wrong checksum", pagesMsgs("go-pg-err", [][]byte{badSum}), []codes.Code{codes.DataLoss}},
		{"a raw sealed page for INT2 K", pagesMsgs("go-pg-err", [][]byte{page(0, 0, B)}),
			[]codes.Code{codes.InvalidArgument}},
		{"head_dim 16 for a 32 model", pagesMsgs("go-pg-err", [][]byte{narrow}),
			[]codes.Code{codes.InvalidArgument}},
		{"pages from block 1", pagesMsgs("go-pg-err", [][]byte{pages[1], pages[4]}),
			[]codes.Code{codes.FailedPrecondition}},
		{"layers that tile different ranges", pagesMsgs("go-pg-err", [][]byte{pages[0], pages[3], pages[4]}),
			[]codes.Code{codes.FailedPrecondition, codes.InvalidArgument}},
		{"pages already stored", pagesMsgs("go-pg-dst", pages), []codes.Code{codes.FailedPrecondition}},
		{"no header", pagesMsgs("go-pg-err", pages)[1:], []codes.Code{codes.InvalidArgument}},
		{"an unknown sequence", pagesMsgs("go-none", pages), []codes.Code{codes.NotFound}},
	}
	for _, c := range cases {
		if msg := try(func() {
			expectCode(errOf(a.appendPages(c.msgs)), c.want...)
			check(s.server.alive(), "kvdepotd died")
			empty("after " + c.what)
		}); msg != "" {
			fail("AppendPages with %s: %s", c.what, msg)
		}
	}
	s.verify("go-pg-raw", "go-pg-raw after the refused calls")
}
