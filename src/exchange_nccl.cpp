// The token exchange over NCCL: the sender gathers its rows by global expert, unpadded, so that
// each EP peer's rows are one range (docs/design.md, "The exchange across EP × DP"); the counts
// and the rows cross by grouped send/receive (ExpertExchange); the receiver sorts the (source,
// expert) chunks into the padded expert-major layout and back. The unpermute weighs the returned
// rows by the probabilities (a probability would need an exchange of its own both ways), so the
// rows the combine got back are kept for dprob.
//
// Capacity mode: the dropped slots (group E of the kept routing) have no row: the sender's layout,
// over the E experts' groups, gives them row -1, so no peer's range holds them and nothing is
// sent for them, and the row kernels add nothing from them to out, dx or dprob.
//
// Fixed blocks (pad_to_capacity): the sender's layout gives every expert exactly C rows (kept
// rows, then zero rows), so each peer gets E_loc · C rows and every size of the step is known on
// the host without a count crossing the mesh: no host synchronisation, and the step can be
// captured in a CUDA graph. Each rank's T is gathered on the device every forward; a forward that
// waits on the host checks that the EP group holds one T (C is each rank's own).
//
// The rows cross on the exchange's own stream, in SlotRouting::expert_chunks chunks of consecutive
// local experts (docs/design.md, "Pipelined exchange"; one chunk of every expert unless asked):
// each chunk's rows cross (each peer's range of the chunk's experts, at the very offsets of the
// exchange in one piece), its chunk sort follows there, and an event hands it to the block's
// stream, whose experts then run on it; an event back lets the chunk's results return while the
// next chunk's products run, and the block's stream takes the returns up where it reads them (the
// unpermute, the permute backward). Every row lands where the exchange in one piece puts it, so
// the results are the same bits for every chunk count. Since the chunks of one buffer are written
// and read at different times, no buffer holds two layouts at once (docs/design.md, "Buffers"):
//   send_rows [T·K, H]: (with fixed blocks E·C rows) x gathered to send → Y returned (kept
//                       for dprob) → received dY → staging of dX
//   X [rows, H]:        (fp8_dispatch: x's records, T of them, gathered from here; more than
//                       [rows, H] where rows < about T / 2) → the experts' input (kept)
//   Y (scratch):        the experts' output → dY to send → returned dX
//   dY (scratch):       received rows → staging of the combine's sends → dY → dX (in place)
// Under fp8_dispatch the rows sent toward the experts are records (fp8_row_bytes(H) each, at most
// a bf16 row's bytes) in the same buffers: x gathered in send_rows, dY to send in Y. Where H is a
// multiple of 128, the chunk sort also leaves the records' codes and scales where the FP8 experts
// read them, so that they do not quantize the rows again:
//   codes [rows, H] bytes, and their scales: X's (read by the forward's first product alone) →
//                       dY's
//
// The copy exchange (ep_transport: copy) is this exchange with its rows moved by the copy engines
// instead of NCCL's kernels, between the GPUs of one host (docs/design.md, "Transports"). The
// counts are all-gathered, so that every rank knows every rank's layouts (src/copy_plan.h): each
// (rank, expert) block of rows is one copy straight into its place in a buffer that every EP rank
// maps, so there is no staging and no chunk sort; a barrier over the EP group follows each
// chunk's copies. Three such buffers replace the NCCL exchange's:
//   expert input:  the experts' input X (kept), padding zeroed on the exchange's stream
//   expert grads:  dY received, then dX in place
//   returned:      Y returned to its senders (kept for dprob), then dX returned
// A barrier only says that rows have landed. That no rank writes a buffer another still reads
// comes from the order of the step: every forward all-gathers the counts on the block's stream,
// which every rank reaches only after its previous step's reads (the block's stream joins the
// exchange's in the unpermute and the permute backward); inside a step, a chunk's rows go to
// rows no earlier chunk uses, and the backward's first copies into `returned` (dX) follow the
// combine backward's barriers, which each sender passes only after its unpermute backward read
// the Y returned there. Fixed blocks, which skip the all-gather, would need another guard: they
// are refused over the copy exchange.
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/exchange.h"
#include "comm/peer_copy.h"
#include "comm/peer_memory.h"
#include "kernels/elementwise.cuh"
#include "kernels/fp8_quantize.cuh"
#include "kernels/permute.cuh"
#include "src/chunk_plan.h"
#include "src/copy_plan.h"
#include "src/exchange_impl.h"
#include "src/stage_support.h"

namespace moe {
namespace {

class NcclExchange final : public TokenExchange {
 public:
  explicit NcclExchange(const ExchangeSetup& setup)
      : config_(setup.config),
        mesh_(setup.mesh),
        stream_(setup.stream),
        ranks_(setup.mesh.ep()),
        E_(setup.config.num_experts),
        E_loc_(setup.config.num_experts / setup.mesh.ep()),
        K_(setup.config.topk),
        H_(setup.config.hidden),
        dtype_(setup.config.dtype),
        row_bytes_(H_ * dtype_size(dtype_)),
        records_toward_experts_(setup.config.fp8_dispatch),
        codes_beside_rows_(records_toward_experts_ && H_ % kFP8Block == 0),
        toward_experts_bytes_(records_toward_experts_ ? fp8_row_bytes(H_)
                                                      : static_cast<std::int64_t>(row_bytes_)),
        exchange_(setup.mesh, setup.config.num_experts),
        layout_(setup.scratch.layout_ws),
        Y_(setup.scratch.Y),
        dY_(setup.scratch.dY),
        chunk_ws_(setup.scratch.chunk_ws) {
    if (setup.config.ep_transport == EpTransport::kCopy) {
      copies_ = std::make_unique<PeerRowCopies>(mesh_, stream_);
      expert_input_ = std::make_unique<PeerBuffer>(mesh_);
      expert_grads_ = std::make_unique<PeerBuffer>(mesh_);
      returned_ = std::make_unique<PeerBuffer>(mesh_);
    }
  }

  // The copy exchange's buffers are mapped by every EP rank: this rank's copies into and out of
  // them finish before the mappings close, within the mesh's timeout, also after an abort (which
  // releases a barrier stuck on a failed peer, so the copies queued behind it run then; the
  // buffers themselves are never freed after an abort).
  ~NcclExchange() override {
    if (!copies_) return;
    try {  // a query that fails (a sticky CUDA error) must not leave the destructor
      if (stream_is_capturing(pipe_.get())) return;
      const Event drained;
      drained.record(pipe_.get());
      mesh_.wait(drained.get(), "the copy exchange's transfers before its buffers are freed");
    } catch (const std::exception&) {
      mesh_.abort();
    }
  }

  EpTransport transport() const override {
    return copies_ ? EpTransport::kCopy : EpTransport::kNccl;
  }
  bool probabilities_in_experts() const override { return false; }

  // Every exchange, counted or fixed, over NCCL or the copy engines, runs on pipe_.
  bool transfers_beside_the_stream() const override { return true; }

  void permute(const Tensor& x, const SlotRouting& routing) override {
    saved_.tokens = x.dim(0);
    saved_.routing = routing;
    fixed_ = routing.fixed_groups;
    fixed_rows_ = routing.expert_group_rows;
    chunk_count_ = std::clamp(routing.expert_chunks, 1, E_loc_);
    if (!fixed_ && !routing.to_host)
      fail("the NCCL exchange: the row counts stay on the device only with fixed blocks");
    // MoEBlock refuses fixed blocks over the copy exchange; this names the cause if not.
    if (fixed_ && copies_)
      fail("pad_to_capacity under EP runs over the NCCL exchange (fixed blocks), for now");
    if (records_toward_experts_ && copies_)
      fail("fp8_dispatch runs over the NCCL exchange, not the copy exchange, for now");
    layout_.build(routing.topk_idx, saved_.tokens, K_, E_, /*align=*/1, stream_,
                  static_cast<int>(fixed_rows_), fixed_rows_ > 0 ? E_ : 0);  // C = 0 at T = 0
    const Tensor slot_rows_bf16 = slots();  // grows send_rows to what the combine returns into
    if (!records_toward_experts_) {
      permute_rows(x, layout_.row_map(), K_, layout_.offsets(), layout_.counts(), E_,
                   slot_rows_bf16, stream_);
      return;
    }
    // Each token's row quantized once into its record, the records gathered slot by slot (a
    // token's K slots share one). The records wait in X, dead since the last backward and written
    // again only by this dispatch's sort, after this permute.
    const Tensor token_records = records(X_, saved_.tokens);
    quantize_row_records(x.data, saved_.tokens, H_, token_records.data, stream_);
    permute_rows(token_records, layout_.row_map(), K_, layout_.offsets(), layout_.counts(), E_,
                 records(send_rows_, slot_rows()), stream_);
  }

  void dispatch(const Tensor&, void* totals) override {
    if (fixed_) {
      dispatch_fixed(totals);
      return;
    }
    auto* recv_counts = typed<std::int32_t>(recv_counts_, E_);
    const ExchangeCounts& c =
        copies_ ? gather_counts(recv_counts, totals)
                : exchange_.exchange_counts(layout_.counts(), recv_counts, saved_.routing.totals,
                                            totals, saved_.routing.totals_bytes, stream_);
    std::vector<std::int64_t> per_expert(E_loc_, 0);
    for (int src = 0; src < ranks_; ++src) {
      for (int e = 0; e < E_loc_; ++e) per_expert[e] += c.received[src * E_loc_ + e];
    }
    saved_.expert_offsets.assign(E_loc_ + 1, 0);
    for (int e = 0; e < E_loc_; ++e)
      saved_.expert_offsets[e + 1] = saved_.expert_offsets[e] + config_.padded_rows(per_expert[e]);
    saved_.rows = saved_.expert_offsets.back();
    if (saved_.rows > INT32_MAX)
      fail("rank {}: its experts would receive {} rows, beyond the int32 row index", mesh_.rank(),
           saved_.rows);
    chunk_ws_.reserve(chunk_workspace_bytes(ranks_, E_loc_));
    plan_pipeline(c.sent, c.received);
    dispatch_chunks(c);
  }

  ExpertRows expert_rows() override {
    const Tensor input = rows(copies_ ? expert_input_->local() : X_.data());
    ExpertRows out{input, view(Y_, dtype_, {saved_.rows, H_}), Tensor{}, saved_.expert_offsets,
                   spans_};
    if (codes_beside_rows_) out.input_codes = codes();
    return out;
  }

  void await_rows(int chunk) override { wait(stream_, arrived_.at(chunk)); }

  // The chunk's Y, back where the dispatch's rows arrived (dead since its sort), then to the
  // senders, where the dispatch took them from.
  void combine(int chunk) override {
    if (copies_) return copy_to_senders(chunk, Y_.data());
    return_chunk(chunk, Y_, dY_, send_rows_);
  }

  void unpermute(const Tensor& out) override {
    join_pipeline();
    unpermute_combine(returned(send_rows_), layout_.row_map(), saved_.routing.topk_p, K_, out,
                      stream_);
  }

  // Against the Y the combine consumed, in the layout it consumed it (docs/design.md, "Combine
  // backward").
  void unpermute_backward(const Tensor& dy, float* dprob) override {
    // dY's buffer grows, where it must, before the backward queues a collective: a growth frees
    // the old buffer, which waits for the device, and so would wait for the peers too.
    if (!copies_) view(dY_, dtype_, {saved_.rows, H_});
    // dY to send goes over Y, dead since the combine (which kept the rows it got back); as records
    // under fp8_dispatch, written in one pass (smaller than the bf16 rows Y was sized for).
    if (records_toward_experts_) {
      combine_backward_records(dy, returned(send_rows_), layout_.row_map(), saved_.routing.topk_p,
                               K_, layout_.offsets(), layout_.counts(), E_,
                               records(Y_, slot_rows()).data, dprob, stream_);
      return;
    }
    const Tensor dY_sent = view(Y_, dtype_, {slot_rows(), H_});
    moe::combine_backward(dy, returned(send_rows_), layout_.row_map(), saved_.routing.topk_p, K_,
                          layout_.offsets(), layout_.counts(), E_, dY_sent, dprob, stream_);
  }

  void combine_backward() override {
    if (copies_) return copy_to_experts(Y_.data(), *expert_grads_);
    // send_rows grows here, on the block's stream alone (its Y returned is dead once the
    // unpermute backward read it): nothing of the exchange's stream is queued yet.
    view(send_rows_, dtype_, {std::max(counts().total_received(), slot_rows()), H_});
    send_chunks(Y_, send_rows_, dY_);
  }

  // dX over dY (X is kept), since Y holds the dY still to send.
  ExpertGradRows expert_grad_rows(const Tensor&) override {
    const Tensor grads = rows(copies_ ? expert_grads_->local() : dY_.data());
    const Tensor input = rows(copies_ ? expert_input_->local() : X_.data());
    ExpertGradRows out{grads, input, grads, Tensor{}, saved_.expert_offsets, {}, spans_};
    if (codes_beside_rows_) out.dY_codes = codes();
    return out;
  }

  // The chunk's dX, back where its dY arrived (dead since its sort), then to the senders, into Y
  // where their dY left (sent already).
  void dispatch_backward(int chunk) override {
    if (copies_) return copy_to_senders(chunk, expert_grads_->local());
    return_chunk(chunk, dY_, send_rows_, Y_);
  }

  // The probabilities were applied in the unpermute backward.
  void permute_backward(const Tensor& dx, float*) override {
    join_pipeline();
    unpermute_combine(returned(Y_), layout_.row_map(), nullptr, K_, dx, stream_);
  }

 private:
  // The rows of the sender's layout: at most T·K, unpadded (a dropped slot has none); with fixed
  // blocks E · C.
  std::int64_t slot_rows() const { return fixed_ ? E_ * fixed_rows_ : saved_.tokens * K_; }
  // This rank's slots' rows in the sender's layout (grows send_rows where needed).
  Tensor slots() { return view(send_rows_, dtype_, {slot_rows(), H_}); }
  // The rows an exchange brought back to this rank, in its sender's layout: in `buffer` (grown
  // where needed) over NCCL, in the returned buffer over the copy engines (sized for the rows this
  // rank sent, its kept slots').
  Tensor returned(DeviceBuffer& buffer) {
    if (copies_) {
      const std::int64_t sent = copy_plan_.slot_rows.at(static_cast<std::size_t>(mesh_.ep_index()));
      return Tensor(returned_->local(), dtype_, {sent, H_});
    }
    return view(buffer, dtype_, {slot_rows(), H_});
  }
  // The padded expert-major rows in a buffer.
  Tensor rows(void* buffer) const { return Tensor(buffer, dtype_, {saved_.rows, H_}); }
  // fp8_dispatch's records of `count` rows in a buffer (grown where needed), as the row kernels
  // move them: 4-byte words, whose bits they copy unchanged.
  Tensor records(DeviceBuffer& buffer, std::int64_t count) {
    return view(buffer, DType::kFP32, {count, fp8_row_bytes(H_) / 4});
  }
  // Under fp8_dispatch with H a multiple of 128: the codes and scales the chunk sort leaves beside
  // the expert-major rows, X's then dY's, grown (before a collective is queued) to `rows`.
  void reserve_codes(std::int64_t rows) {
    if (!codes_beside_rows_) return;
    codes_.reserve(static_cast<std::size_t>(std::max<std::int64_t>(rows * H_, 16)));
    code_scales_.reserve(
        static_cast<std::size_t>(std::max<std::int64_t>(rows * (H_ / kFP8Block), 1)) *
        sizeof(float));
  }
  QuantizedRows codes() const {
    if (!codes_beside_rows_) return {};
    return {codes_.as<std::uint8_t>(), code_scales_.as<float>()};
  }
  const ExchangeCounts& counts() const {
    if (fixed_) return fixed_counts_;
    return copies_ ? copy_plan_.counts : exchange_.counts();
  }

  // Fixed blocks: the sizes are the host's; the losses (and the EP group's token counts, checked
  // here) come to the host only where the forward waits for them.
  void dispatch_fixed(void* totals) {
    const std::int64_t C = fixed_rows_, T = saved_.tokens;
    // Every buffer of the step grows here, before the exchange queues its collectives (a growth
    // frees the old buffer, which waits for the device): the same sizes every step at this T.
    const std::int64_t received = std::int64_t{ranks_} * E_loc_ * C;
    view(Y_, dtype_, {std::max(received, slot_rows()), H_});
    view(X_, dtype_, {received, H_});
    view(dY_, dtype_, {received, H_});
    reserve_codes(received);
    chunk_ws_.reserve(chunk_workspace_bytes(ranks_, E_loc_));
    // Every rank's T, gathered every forward (so that the collectives line up whether or not a
    // rank waits), read where this one waits.
    auto* tokens = typed<std::int64_t>(tokens_, 1 + static_cast<std::size_t>(ranks_));
    write_values(tokens, std::span(&T, 1), stream_);
    mesh_.all_gather(tokens, tokens + 1, sizeof(std::int64_t), MeshGroup::kExpertParallel, stream_);
    if (saved_.routing.to_host) {
      const std::size_t totals_bytes = saved_.routing.totals_bytes;
      const std::size_t tokens_bytes = ranks_ * sizeof(std::int64_t);
      host_.reserve(totals_bytes + tokens_bytes);
      auto* host = host_.as<char>();
      MOE_CHECK_CUDA(cudaMemcpyAsync(host, saved_.routing.totals, totals_bytes,
                                     cudaMemcpyDeviceToHost, stream_));
      MOE_CHECK_CUDA(cudaMemcpyAsync(host + totals_bytes, tokens + 1, tokens_bytes,
                                     cudaMemcpyDeviceToHost, stream_));
      copied_.record(stream_);
      mesh_.wait(copied_.get(), "the forward's losses and the EP group's token counts");
      std::memcpy(totals, host, totals_bytes);
      std::vector<std::int64_t> all(ranks_);
      std::memcpy(all.data(), host + totals_bytes, tokens_bytes);
      if (std::any_of(all.begin(), all.end(), [T](std::int64_t t) { return t != T; }))
        fail(
            "pad_to_capacity under EP needs the same T on every rank of an EP group (each rank's "
            "C comes from its own T); the EP group's ranks hold {} tokens",
            fmt::join(all, ", "));
    }
    fixed_counts_.send_rows.assign(ranks_, E_loc_ * C);
    fixed_counts_.recv_rows.assign(ranks_, E_loc_ * C);
    fixed_counts_.sent.assign(E_, static_cast<std::int32_t>(C));
    fixed_counts_.received.assign(static_cast<std::size_t>(ranks_) * E_loc_,
                                  static_cast<std::int32_t>(C));
    // Expert e's group: the EP sources' blocks of C rows in source order, EP · C rows.
    saved_.expert_offsets.resize(static_cast<std::size_t>(E_loc_) + 1);
    for (int e = 0; e <= E_loc_; ++e) saved_.expert_offsets[e] = std::int64_t{e} * ranks_ * C;
    saved_.rows = saved_.expert_offsets.back();
    plan_pipeline(fixed_counts_.sent, fixed_counts_.received);
    dispatch_chunks(fixed_counts_);
  }

  // ---- The copy exchange ----------------------------------------------------------------------

  // Every EP rank's rows per group, all-gathered with routing.totals in the forward's one host
  // synchronisation, give the plan of every copy (and this rank's counts); this rank's received
  // counts (for the padding) are copied out of them on the device.
  const ExchangeCounts& gather_counts(std::int32_t* recv_counts, void* totals) {
    const int me = mesh_.ep_index();
    const std::size_t counts = static_cast<std::size_t>(ranks_) * E_;
    const std::size_t counts_bytes = counts * sizeof(std::int32_t);
    const std::size_t totals_bytes = saved_.routing.totals_bytes;
    auto* all = typed<std::int32_t>(all_counts_, counts);
    mesh_.all_gather(layout_.counts(), all, E_ * sizeof(std::int32_t), MeshGroup::kExpertParallel,
                     stream_);
    // received[s · E_loc + e] = all[s · E + me · E_loc + e]: one row of E_loc per source.
    MOE_CHECK_CUDA(cudaMemcpy2DAsync(recv_counts, E_loc_ * sizeof(std::int32_t),
                                     all + static_cast<std::size_t>(me) * E_loc_,
                                     E_ * sizeof(std::int32_t), E_loc_ * sizeof(std::int32_t),
                                     ranks_, cudaMemcpyDeviceToDevice, stream_));
    host_.reserve(totals_bytes + counts_bytes);
    auto* host = host_.as<char>();
    MOE_CHECK_CUDA(cudaMemcpyAsync(host, saved_.routing.totals, totals_bytes,
                                   cudaMemcpyDeviceToHost, stream_));
    MOE_CHECK_CUDA(
        cudaMemcpyAsync(host + totals_bytes, all, counts_bytes, cudaMemcpyDeviceToHost, stream_));
    copied_.record(stream_);
    mesh_.wait(copied_.get(), "the dispatch counts all-gather");  // the one host synchronisation
    std::memcpy(totals, host, totals_bytes);
    std::vector<std::int32_t> all_counts(counts);
    std::memcpy(all_counts.data(), host + totals_bytes, counts_bytes);
    copy_plan_ = plan_copies(all_counts, ranks_, me, E_loc_, near_equal_spans(E_loc_, chunk_count_),
                             config_);
    return copy_plan_.counts;
  }

  // Every buffer the copies land in grows now, collectively (every rank knows every rank's
  // need), before any row is queued: a growth remaps, which waits for the block's stream.
  void reserve_copy_buffers() {
    const auto bytes = [this](std::span<const std::int64_t> rows) {
      std::vector<std::size_t> out;
      for (const std::int64_t r : rows) out.push_back(static_cast<std::size_t>(r) * row_bytes_);
      return out;
    };
    expert_input_->reserve(bytes(copy_plan_.expert_rows), stream_);
    expert_grads_->reserve(bytes(copy_plan_.expert_rows), stream_);
    returned_->reserve(bytes(copy_plan_.slot_rows), stream_);
  }

  // Each chunk's blocks to the experts' ranks, into `rows_out`, from the sender's layout in
  // `slots_buffer`; the padding of this rank's layout becomes zero first (no copy writes it).
  void copy_to_experts(const void* slots_buffer, PeerBuffer& rows_out) {
    start_pipeline();
    zero_chunk_padding(chunks(), rows(rows_out.local()), pipe_.get());
    for (int chunk = 0; chunk < std::ssize(spans_); ++chunk) {
      copies_->copy(slots_buffer, copy_plan_.to_experts[chunk], rows_out, row_bytes_, pipe_.get());
      arrived_[chunk].record(pipe_.get());
    }
  }

  // A chunk's results (expert-major, in `results`) back to their senders' returned rows once its
  // experts are done; the last chunk ends the pipeline.
  void copy_to_senders(int chunk, const void* results) {
    start_chunk(chunk);
    copies_->copy(results, copy_plan_.to_senders.at(chunk), *returned_, row_bytes_, pipe_.get());
    if (chunk + 1 == std::ssize(spans_)) finish_pipeline();
  }

  // ---- The pipeline ---------------------------------------------------------------------------

  // Each chunk's experts and its rows in every exchange (src/chunk_plan.h).
  void plan_pipeline(std::span<const std::int32_t> sent, std::span<const std::int32_t> received) {
    spans_ = near_equal_spans(E_loc_, chunk_count_);
    ranges_ = plan_chunk_ranges(sent, received, ranks_, E_loc_, spans_);
    while (std::ssize(arrived_) < chunk_count_) {
      arrived_.emplace_back();
      computed_.emplace_back();
    }
  }

  // Every chunk's rows to its experts on the exchange's stream, each chunk sorted as it lands.
  void dispatch_chunks(const ExchangeCounts& c) {
    if (copies_) {
      // Y holds the experts' output, then the backward's dY to send (both local).
      view(Y_, dtype_, {std::max(saved_.rows, slot_rows()), H_});
      reserve_copy_buffers();
      copy_to_experts(send_rows_.data(), *expert_input_);
      return;
    }
    // Every buffer of the forward grows now, before a collective is queued (a growth frees the old
    // buffer, which waits for the device): dY receives, X gets the sorted rows, Y the output, and
    // later the backward's dY to send.
    view(dY_, dtype_, {std::max(c.total_received(), saved_.rows), H_});
    view(X_, dtype_, {saved_.rows, H_});
    view(Y_, dtype_, {std::max(saved_.rows, slot_rows()), H_});
    reserve_codes(saved_.rows);
    send_chunks(send_rows_, dY_, X_);
  }

  // Every chunk's rows of the sender's layout in `slots_buffer` to their experts on the
  // exchange's stream: received into `staging` (source-major), each chunk sorted into `rows_out`
  // as it lands, and an event for the block's stream (await_rows).
  void send_chunks(const DeviceBuffer& slots_buffer, DeviceBuffer& staging,
                   DeviceBuffer& rows_out) {
    start_pipeline();
    for (int chunk = 0; chunk < std::ssize(spans_); ++chunk) {
      const ChunkRanges& r = ranges_[chunk];
      exchange_.exchange_row_ranges(slots_buffer.data(), r.send_offsets, r.send_rows,
                                    staging.data(), r.recv_offsets, r.recv_rows,
                                    static_cast<std::size_t>(toward_experts_bytes_), pipe_.get());
      if (records_toward_experts_) {
        sort_chunk_records(chunks(chunk), staging.data(), counts().total_received(),
                           rows(rows_out.data()), pipe_.get(), codes());
      } else {
        sort_chunks(chunks(chunk), received(staging.data()), rows(rows_out.data()), pipe_.get());
      }
      arrived_[chunk].record(pipe_.get());
    }
  }

  // A chunk's results back to their senders once the work queued on the block's stream so far
  // (the chunk's experts; in the backward's last chunk, its dX products alone) is done: its rows of
  // `results` unsorted into `staging` at the offsets they arrived at, then sent into the senders'
  // `slots_buffer` at the offsets they left from. The last chunk ends the pipeline.
  void return_chunk(int chunk, const DeviceBuffer& results, DeviceBuffer& staging,
                    DeviceBuffer& slots_buffer) {
    const ChunkRanges& r = start_chunk(chunk);
    unsort_chunks(chunks(chunk), rows(results.data()), received(staging.data()), pipe_.get());
    exchange_.exchange_row_ranges(staging.data(), r.recv_offsets, r.recv_rows, slots_buffer.data(),
                                  r.send_offsets, r.send_rows, row_bytes_, pipe_.get());
    if (chunk + 1 == std::ssize(spans_)) finish_pipeline();
  }

  static void wait(cudaStream_t stream, const Event& event) {
    MOE_CHECK_CUDA(cudaStreamWaitEvent(stream, event.get(), 0));
  }
  // The exchange's stream takes up after the work queued on the block's stream so far.
  void start_pipeline() {
    began_.record(stream_);
    wait(pipe_.get(), began_);
  }
  // A chunk's return waits for what the block's stream queued so far (its experts' results).
  const ChunkRanges& start_chunk(int chunk) {
    computed_.at(chunk).record(stream_);
    wait(pipe_.get(), computed_[chunk]);
    return ranges_[chunk];
  }
  // After the last chunk's return. The block's stream takes up after the exchange's only where it
  // reads the returned rows (join_pipeline), so that what a trainer queues before then runs beside
  // the transfers.
  void finish_pipeline() { finished_.record(pipe_.get()); }
  void join_pipeline() { wait(stream_, finished_); }
  // The source-major rows received in a buffer (it has grown to hold them).
  Tensor received(void* buffer) const {
    return Tensor(buffer, dtype_, {counts().total_received(), H_});
  }
  ChunkArgs chunks(int chunk) const {
    ChunkArgs args = chunks();
    args.first_expert = spans_[chunk].first;
    args.end_expert = spans_[chunk].end;
    args.widest_source = ranges_[chunk].widest_source;
    return args;
  }

  ChunkArgs chunks() const {
    ChunkArgs args{.counts = recv_counts_.as<std::int32_t>(),
                   .sources = ranks_,
                   .local_experts = E_loc_,
                   .align = config_.align_size,
                   .workspace = chunk_ws_.data()};
    if (fixed_) {  // every (source, expert) block C rows: no counts on the device
      args.counts = nullptr;
      args.uniform_count = static_cast<int>(fixed_rows_);
    }
    return args;
  }

  MoEConfig config_;
  const Mesh& mesh_;
  cudaStream_t stream_;
  int ranks_, E_, E_loc_, K_;
  std::int64_t H_;
  DType dtype_;
  std::size_t row_bytes_;
  // fp8_dispatch: the rows toward the experts (x, then dY) cross as records of E4M3 codes and
  // scales, toward_experts_bytes_ a row, and the chunk sort decodes them; the rows back stay bf16.
  // The records take no buffer of their own (see the buffers' roles above).
  bool records_toward_experts_;
  bool codes_beside_rows_;  // and their codes and scales left for the FP8 experts (H % 128 == 0)
  std::int64_t toward_experts_bytes_;
  ExpertExchange exchange_;  // the counts (kept for the backward) and the rows' all-to-allv
  SlotLayout layout_;
  DeviceBuffer send_rows_, X_;
  DeviceBuffer codes_, code_scales_;   // codes_beside_rows_: X's, then dY's
  DeviceBuffer recv_counts_;           // [EP · E_loc]: rows from source s for local expert e
  DeviceBuffer &Y_, &dY_, &chunk_ws_;  // the scratch's
  // Fixed blocks: C (0 without), the sizes of every exchange, this rank's T then the EP group's,
  // and the host's copy of the losses and the group's T.
  bool fixed_ = false;
  std::int64_t fixed_rows_ = 0;
  ExchangeCounts fixed_counts_;
  DeviceBuffer tokens_;
  PinnedBuffer host_;
  Event copied_;

  // The copy exchange (null over NCCL): the copies, the buffers the rows land in, every EP rank's
  // rows per expert [EP, E] (all-gathered), and the step's plan of copies.
  std::unique_ptr<PeerRowCopies> copies_;
  std::unique_ptr<PeerBuffer> expert_input_, expert_grads_, returned_;
  DeviceBuffer all_counts_;
  CopyPlan copy_plan_;

  // The pipeline: the chunks asked for, each chunk's experts and ranges, the
  // exchange's stream, and the events that hand chunks between it and the block's stream.
  int chunk_count_ = 1;
  std::vector<ExpertSpan> spans_;
  std::vector<ChunkRanges> ranges_;
  // At the device's greatest priority: its kernels (NCCL's, the copies' signals, the chunks'
  // staging) start ahead of the expert products' waiting blocks, so that the transfers begin
  // as soon as their rows are ready rather than when an SM frees up behind the products.
  Stream pipe_{StreamPriority::kGreatest};
  ExchangeStreamRegistration registered_{pipe_.get(), mesh_};
  std::vector<Event> arrived_, computed_;
  Event began_, finished_;

  // What the forward keeps for the backward, beside the layout, the counts, send_rows and X.
  struct Saved {
    SlotRouting routing;
    std::int64_t tokens = 0;
    std::int64_t rows = 0;  // padding included
    std::vector<std::int64_t> expert_offsets;
  } saved_;
};

}  // namespace

std::unique_ptr<TokenExchange> make_nccl_exchange(const ExchangeSetup& setup) {
  return std::make_unique<NcclExchange>(setup);
}

}  // namespace moe
