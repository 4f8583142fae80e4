// A fault on one rank, at every stage of a step, becomes a moe::Error on every rank within the
// mesh's timeout: rank 1 throws, or stalls past the timeout, as it enters the stage (the stage
// hook of src/stage_support.h); every rank runs forward, backward, reduce_gradients and
// synchronize and must throw, in bounded time, and leave its mesh aborted. Needs two ranks.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "moe/mesh.h"
#include "moe/moe_block.h"
#include "src/stage_support.h"
#include "support/block_util.h"
#include "support/catch.h"
#include "support/mesh_checks.h"
#include "support/test_main.h"

using namespace moe;

namespace {

constexpr auto kTimeout = std::chrono::milliseconds(2000);

const char* const kStages[] = {"moe gate",
                               "moe router",
                               "moe losses",
                               "moe dispatch",
                               "moe experts",
                               "moe combine",
                               "moe combine backward",
                               "moe experts backward",
                               "moe dispatch backward",
                               "moe router backward",
                               "moe gate backward",
                               "moe gradient reduction"};

// A stall costs up to three timeouts per case: it is tried at one stage of each kind (local
// compute, a host wait on the exchange, an exchange without one, the gradient all-reduce).
const char* const kStallStages[] = {"moe gate", "moe dispatch", "moe experts backward",
                                    "moe gradient reduction"};

enum class Fault { kThrows, kStalls };

// MOE_TEST_TRACE=1 prints, per rank, each stage entered and each case's outcome: where a rank
// stopped when a case does not end.
bool tracing() {
  static const bool on = [] {
    const char* value = std::getenv("MOE_TEST_TRACE");
    return value != nullptr && std::strcmp(value, "0") != 0;
  }();
  return on;
}

void trace(const std::string& line) {
  if (!tracing()) return;
  std::fprintf(stderr, "[rank %d] %s\n", test::world_rank(), line.c_str());
  std::fflush(stderr);
}

// Removes the hook when the case ends, whatever happens in it.
struct HookGuard {
  ~HookGuard() { set_stage_hook({}); }
};

struct Outcome {
  bool threw = false;
  std::string message;
  std::chrono::steady_clock::duration elapsed{};
};

// Runs `calls`: whether they threw moe::Error, its message, and how long they took.
template <typename Calls>
Outcome outcome_of(Calls&& calls) {
  Outcome outcome;
  const auto start = std::chrono::steady_clock::now();
  try {
    calls();
  } catch (const Error& error) {
    outcome.threw = true;
    outcome.message = error.what();
  }
  outcome.elapsed = std::chrono::steady_clock::now() - start;
  return outcome;
}

// Rank 1 sleeps `stall` as it enters the gradient reduction, before its all-reduce is queued
// (a HookGuard removes the hook).
void stall_rank_one_before_its_all_reduce(std::chrono::milliseconds stall) {
  const int rank = test::world_rank();
  set_stage_hook([rank, stall](const char* name) {
    if (rank == 1 && std::strcmp(name, "moe gradient reduction") == 0)
      std::this_thread::sleep_for(stall);
  });
}

// A block over EP = every rank, with this rank's input and output gradient, after one clean
// step: the transport is chosen and every connection made.
class SteppedBlock {
 public:
  // exchange_chunks 0 is the transport's automatic count.
  explicit SteppedBlock(EpTransport transport, int exchange_chunks = 0)
      : config_(make_config(transport, exchange_chunks)),
        mesh_(Mesh::from_mpi(MPI_COMM_WORLD, config_.ep, 1, config_.num_experts, kTimeout)),
        block_(std::in_place, config_, mesh_, stream_.get()) {
    std::mt19937_64 rng(7 + test::world_rank());
    x_ = test::upload_as(test::random_matrix(kTokens, config_.hidden, rng), config_.dtype);
    dy_ = test::upload_as(test::random_matrix(kTokens, config_.hidden, rng), config_.dtype);
    step();
    trace("the clean step ended");
    MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
  }
  void forward_backward() {
    (void)block_->forward(x());
    (void)block_->backward(Tensor(dy_.data(), config_.dtype, {kTokens, config_.hidden}));
  }
  // forward, backward, reduce_gradients, synchronize.
  void step() {
    forward_backward();
    block_->reduce_gradients();
    block_->synchronize();
  }
  Tensor x() const { return Tensor(x_.data(), config_.dtype, {kTokens, config_.hidden}); }
  const MoEConfig& config() const { return config_; }
  static constexpr std::int64_t tokens() { return kTokens; }
  MoEBlock& block() { return *block_; }
  const Mesh& mesh() const { return mesh_; }
  // Destroys the block alone, the mesh kept; rebuild_block() makes a new one on the same mesh.
  void destroy_block() { block_.reset(); }
  void rebuild_block() { block_.emplace(config_, mesh_, stream_.get()); }

 private:
  static constexpr std::int64_t kTokens = 24;
  static MoEConfig make_config(EpTransport transport, int exchange_chunks) {
    MoEConfig c = test::small_config(32, 24, 2 * test::world_size(), 2);
    c.ep = test::world_size();
    c.ep_transport = transport;
    c.exchange_chunks = exchange_chunks;
    c.gemm_autotune = false;
    c.validate();
    trace("a new mesh");
    return c;
  }
  MoEConfig config_;
  Mesh mesh_;
  Stream stream_;
  std::optional<MoEBlock> block_;
  DeviceBuffer x_, dy_;
};

// How a case's block runs: its exchange's chunks (0: the transport's automatic count), and check
// mode, whose host waits for each stage's output.
struct CaseSetup {
  int exchange_chunks = 0;
  bool check_finite = false;
};

Outcome run_step_with_fault(const char* stage, Fault fault, EpTransport transport,
                            CaseSetup setup) {
  const int rank = test::world_rank();
  SteppedBlock stepped(transport, setup.exchange_chunks);
  stepped.block().set_check_finite(setup.check_finite);
  HookGuard guard;
  trace(std::string("case: ") + (fault == Fault::kThrows ? "throws" : "stalls") + " at '" + stage +
        "', transport " + std::string(ep_transport_name(transport)) + ", " +
        std::to_string(setup.exchange_chunks) + " chunks" +
        (setup.check_finite ? ", check mode" : ""));
  if (rank == 1 || tracing()) {
    // A stage may be entered more than once a step (the chunks' waits for rows count as the
    // exchange's stages): rank 1 stalls at its first entry only, one stall a step.
    auto stalled = std::make_shared<bool>(false);
    set_stage_hook([stage, fault, rank, stalled](const char* name) {
      trace(std::string("enters '") + name + "'");
      if (rank != 1 || std::strcmp(name, stage) != 0 || *stalled) return;
      if (fault == Fault::kThrows) fail("injected fault");
      *stalled = true;
      std::this_thread::sleep_for(2 * kTimeout);
    });
  }
  const Outcome outcome = outcome_of([&] { stepped.step(); });
  trace((outcome.threw ? "threw after " : "returned after ") +
        std::to_string(
            std::chrono::duration_cast<std::chrono::milliseconds>(outcome.elapsed).count()) +
        " ms: " + outcome.message);
  CHECK(stepped.mesh().aborted());
  return outcome;
}

constexpr EpTransport kNcclAndAuto[] = {EpTransport::kNccl, EpTransport::kAuto};

void check_fault_on_every_rank(Fault fault, std::span<const EpTransport> transports = kNcclAndAuto,
                               std::span<const char* const> stages = {}, CaseSetup setup = {}) {
  if (stages.empty()) {
    stages = fault == Fault::kThrows ? std::span<const char* const>(kStages)
                                     : std::span<const char* const>(kStallStages);
  }
  for (const EpTransport transport : transports) {
    for (const char* stage : stages) {
      INFO("stage '" << stage << "', " << (fault == Fault::kThrows ? "throws" : "stalls")
                     << ", transport " << ep_transport_name(transport) << ", "
                     << setup.exchange_chunks << " chunks, check mode " << setup.check_finite
                     << ", rank " << test::world_rank());
      const Outcome outcome = run_step_with_fault(stage, fault, transport, setup);
      INFO(outcome.message);
      CHECK(outcome.threw);
      // A throw is seen at once by its rank and within a timeout by the others; a stalled rank
      // wakes after two timeouts and then waits one more on its aborted peers.
      const auto bound = (fault == Fault::kThrows ? 2 : 4) * kTimeout + std::chrono::seconds(5);
      CHECK(outcome.elapsed < bound);
      if (test::world_rank() == 1 && fault == Fault::kThrows) {
        CHECK_THAT(outcome.message, test::contains_text("rank 1: MoEBlock::") &&
                                        test::contains_text(std::string("'") + stage + "'") &&
                                        test::contains_text("injected fault"));
      } else {
        CHECK_THAT(outcome.message, test::contains_text("did not complete within 2000 ms") ||
                                        test::contains_text("aborted"));
      }
      trace("the case's mesh and block are gone");
      MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    }
  }
}

}  // namespace

TEST_CASE("a rank that throws at any stage is an error on every rank", "[mpi][fault]") {
  if (test::world_size() < 2) {
    WARN("needs two ranks; nothing to check with one");
    return;
  }
  check_fault_on_every_rank(Fault::kThrows);
}

// The stalled rank itself may see its late collectives complete over what its aborted peers left
// behind: it must still throw, at the latest in synchronize().
TEST_CASE("a rank that stalls past the timeout is an error on every rank, itself included",
          "[mpi][fault]") {
  if (test::world_size() < 2) {
    WARN("needs two ranks; nothing to check with one");
    return;
  }
  check_fault_on_every_rank(Fault::kStalls);
}

// The copy exchange's barriers follow copies into other processes' memory: a peer that stalls or
// throws before its copies must still become an error on every rank in time, and the ranks must
// tear their mapped buffers down without waiting for it. With the exchange in one piece, rank 1
// fails before its dispatch's, its combine's and its dispatch backward's copies; in two chunks it
// stalls while the second chunk's copies are still queued behind the first chunk's barrier, which
// the others' abort must drain.
TEST_CASE("a rank that fails inside the copy exchange is an error on every rank", "[mpi][fault]") {
  if (test::world_size() < 2 || !test::host_gpus_have_peer_access()) {
    WARN("needs two ranks whose GPUs have peer access; nothing to check without");
    return;
  }
  constexpr EpTransport copy[] = {EpTransport::kCopy};
  constexpr const char* stall_stages[] = {"moe dispatch", "moe experts", "moe experts backward"};
  check_fault_on_every_rank(Fault::kStalls, copy, stall_stages, {.exchange_chunks = 1});
  constexpr const char* throw_stages[] = {"moe experts"};
  check_fault_on_every_rank(Fault::kThrows, copy, throw_stages, {.exchange_chunks = 1});
  constexpr const char* chunked_stall_stages[] = {"moe experts"};
  check_fault_on_every_rank(Fault::kStalls, copy, chunked_stall_stages, {.exchange_chunks = 2});
}

// Check mode waits on the host for each stage's output, and on a mesh a stage's rows may be on
// their way from a peer that stalls: that wait too must end within the timeout. Rank 1 stalls
// before its experts, so that rank 0's first wait that blocks is check mode's, for its combined
// output, which holds rows rank 1 has not returned; without the bounded wait rank 0 would block
// until rank 1 woke, and the step would then end without an error.
TEST_CASE("check mode's waits are bounded on a mesh", "[mpi][fault]") {
  if (test::world_size() < 2) {
    WARN("needs two ranks; nothing to check with one");
    return;
  }
  std::vector<EpTransport> transports = {EpTransport::kNccl};
  if (test::host_gpus_have_peer_access()) transports.push_back(EpTransport::kCopy);
  constexpr const char* stages[] = {"moe experts"};
  check_fault_on_every_rank(Fault::kStalls, transports, stages,
                            {.exchange_chunks = 1, .check_finite = true});
}

// A buffer's growth frees the old one, and a free waits for the whole device with no time limit:
// behind a gradient all-reduce that a failed peer never joins, forever. Here rank 1 stalls past
// the timeout in reduce_gradients; rank 0 has queued its all-reduce and starts a step on four
// times the tokens, whose first growth (the gate's logits, before any other wait) must wait for
// its stream under the mesh's timeout instead and fail. Without that wait rank 0's free would
// return once rank 1 woke and joined, and the step would end without an error: the checks that
// every rank throws, and rank 0 naming the growth, tell the two apart.
TEST_CASE("a buffer's growth behind a collective a peer never joined is an error in time",
          "[mpi][fault]") {
  if (test::world_size() < 2) {
    WARN("needs two ranks; nothing to check with one");
    return;
  }
  const int rank = test::world_rank();
  SteppedBlock stepped(EpTransport::kNccl);
  const MoEConfig& c = stepped.config();
  const std::int64_t big = 4 * SteppedBlock::tokens();
  std::mt19937_64 rng(11 + rank);
  const DeviceBuffer x_big = test::upload_as(test::random_matrix(big, c.hidden, rng), c.dtype);
  HookGuard guard;
  stall_rank_one_before_its_all_reduce(2 * kTimeout);
  const Outcome outcome = outcome_of([&] {
    stepped.forward_backward();
    stepped.block().reduce_gradients();
    (void)stepped.block().forward(Tensor(x_big.data(), c.dtype, {big, c.hidden}));
    stepped.block().synchronize();
  });
  INFO("rank " << rank << ": " << outcome.message);
  CHECK(outcome.threw);
  CHECK(outcome.elapsed < 4 * kTimeout + std::chrono::seconds(5));
  CHECK(stepped.mesh().aborted());
  if (rank == 0) {
    CHECK_THAT(outcome.message, test::contains_text("before a buffer grows") &&
                                    test::contains_text("did not complete within 2000 ms"));
  }
  MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
}

// A block's destructor frees its buffers, and a free waits for the whole device with no time
// limit: behind the block's gradient all-reduce that a stalled peer has not joined, as long as the
// peer stalls. Here rank 1 stalls three timeouts in reduce_gradients while rank 0, its all-reduce
// queued, destroys its block: that must return after one timeout and a little more, the mesh
// aborted, and rank 1 must then fail in time. Without the destructor's wait rank 0 would return
// only once rank 1 woke and joined, three timeouts later.
TEST_CASE("a block destroyed behind a collective a peer never joined returns in time",
          "[mpi][fault]") {
  if (test::world_size() < 2) {
    WARN("needs two ranks; nothing to check with one");
    return;
  }
  const int rank = test::world_rank();
  std::optional<SteppedBlock> stepped(std::in_place, EpTransport::kNccl);
  HookGuard guard;
  stall_rank_one_before_its_all_reduce(3 * kTimeout);
  stepped->forward_backward();
  if (rank == 0) {
    stepped->block().reduce_gradients();  // queued; rank 1 has not joined
    const Mesh& mesh = stepped->mesh();
    const auto start = std::chrono::steady_clock::now();
    const bool aborted_before = mesh.aborted();
    stepped->destroy_block();
    const auto elapsed = std::chrono::steady_clock::now() - start;
    CHECK_FALSE(aborted_before);
    CHECK(mesh.aborted());
    CHECK(elapsed >= kTimeout - std::chrono::milliseconds(100));  // it waited, then aborted
    CHECK(elapsed < kTimeout + std::chrono::seconds(2));
  } else {
    const Outcome outcome = outcome_of([&] {
      stepped->block().reduce_gradients();
      stepped->block().synchronize();
    });
    INFO("rank " << rank << ": " << outcome.message);
    CHECK(outcome.threw);
    CHECK(outcome.elapsed < 4 * kTimeout + std::chrono::seconds(5));
  }
  stepped.reset();
  MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
}

// The destructor's wait must not turn a healthy end into a failure: ranks that destroy their
// blocks with a gradient all-reduce still queued, none of them stalled, wait only for that
// all-reduce, and the mesh stays usable for a new block.
TEST_CASE("blocks destroyed with their all-reduce queued leave a healthy mesh", "[mpi][fault]") {
  if (test::world_size() < 2) {
    WARN("needs two ranks; nothing to check with one");
    return;
  }
  SteppedBlock stepped(EpTransport::kNccl);
  stepped.forward_backward();
  stepped.block().reduce_gradients();  // queued, not waited for
  const auto start = std::chrono::steady_clock::now();
  stepped.destroy_block();
  const auto elapsed = std::chrono::steady_clock::now() - start;
  CHECK_FALSE(stepped.mesh().aborted());
  CHECK(elapsed < kTimeout);
  stepped.rebuild_block();
  CHECK_NOTHROW(stepped.step());
  MOE_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
}

// Run by tests/support/rank_exit.sh, which checks that the job ends: rank 1 leaves the process as
// it enters the dispatch, without finalising MPI. Open MPI then ends the job; a rank it had not
// yet ended and that is blocked on the exchange is released by the mesh's timeout and says so.
TEST_CASE("a rank that exits mid-step ends the job", "[.rank-exits]") {
  REQUIRE(test::world_size() >= 2);
  const int rank = test::world_rank();
  SteppedBlock stepped(EpTransport::kAuto);
  HookGuard guard;
  set_stage_hook([rank](const char* name) {
    if (rank != 1 || std::strcmp(name, "moe dispatch") != 0) return;
    std::fprintf(stderr, "[rank 1] exits at 'moe dispatch'\n");
    std::fflush(stderr);
    std::_Exit(3);
  });
  try {
    (void)stepped.block().forward(stepped.x());
    stepped.block().synchronize();
  } catch (const Error& error) {
    std::fprintf(stderr, "[rank %d] %s\n", rank, error.what());
    std::fflush(stderr);
  }
  CHECK(stepped.mesh().aborted());
}
