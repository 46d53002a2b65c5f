// Drives ConnectorBase's batch completion path from several worker threads,
// built with -fsanitize=thread by test_0002_batch_completion_ordering.py.
//
// A batch GET is split into one tile per worker; each tile writes its keys'
// per-key results and decrements remaining_tiles, and the last tile hands
// per_key_results to the completion that this (main) thread drains.
//
// Every tile waits in do_single_get until all kWorkers tiles are inside it, so
// each runs on its own worker and all were taken from the request queue
// before any result is written. Without that rendezvous a loaded machine can
// run every tile on one worker, whose own program order hides the race. The
// rendezvous uses relaxed atomics only, which ThreadSanitizer does not count
// as synchronisation: whichever tile finishes last, the other tiles' result
// writes reach the main thread only through the decrement, and TSan reports a
// data race on them unless the decrement orders them (acq_rel).
#include "connector_base.h"

#include <poll.h>

#include <atomic>
#include <cstdlib>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace lc = lmcache::connector;

namespace {

constexpr int kWorkers = 4;
constexpr int kBatches = 20;
constexpr auto kRendezvousBound = std::chrono::seconds(30);

std::atomic<int> arrivals{0};

// Returns once kWorkers calls of this batch have arrived. Relaxed on purpose:
// it must not order one tile's writes before another's reads.
void wait_for_every_tile() {
  int arrived = arrivals.fetch_add(1, std::memory_order_relaxed) + 1;
  int batch_end = ((arrived - 1) / kWorkers + 1) * kWorkers;
  auto deadline = std::chrono::steady_clock::now() + kRendezvousBound;
  while (arrivals.load(std::memory_order_relaxed) < batch_end) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "only %d of %d tiles reached the rendezvous in %lld s\n",
                   arrivals.load(std::memory_order_relaxed), batch_end,
                   static_cast<long long>(kRendezvousBound.count()));
      std::abort();
    }
    std::this_thread::yield();
  }
}

class RendezvousConnector : public lc::ConnectorBase<int> {
 public:
  RendezvousConnector() : ConnectorBase(kWorkers) { start_workers(); }
  ~RendezvousConnector() override { close(); }

 protected:
  int create_connection() override { return 0; }
  void do_single_get(int&, const std::string&, void* buf, size_t len,
                     size_t) override {
    wait_for_every_tile();
    std::memset(buf, 0x5a, len);
  }
  void do_single_set(int&, const std::string&, const void*, size_t,
                     size_t) override {}
  bool do_single_exists(int&, const std::string&) override { return true; }
};

}  // namespace

int main() {
  RendezvousConnector connector;
  std::vector<std::string> keys;
  for (int i = 0; i < kWorkers; ++i) keys.push_back("k" + std::to_string(i));

  int bad = 0;
  for (int batch = 0; batch < kBatches; ++batch) {
    std::vector<std::vector<char>> storage(kWorkers, std::vector<char>(64));
    std::vector<void*> bufs;
    std::vector<size_t> lens;
    for (auto& s : storage) {
      bufs.push_back(s.data());
      lens.push_back(s.size());
    }
    uint64_t id = connector.submit_batch_get(keys, bufs, lens, 64);

    bool done = false;
    while (!done) {
      pollfd pfd{connector.event_fd(), POLLIN, 0};
      if (::poll(&pfd, 1, 10000) <= 0) {
        std::fprintf(stderr, "no completion within 10 s\n");
        return 2;
      }
      for (auto& c : connector.drain_completions()) {
        if (c.future_id != id) continue;
        done = true;
        if (!c.ok || c.result_bytes.size() != keys.size()) {
          ++bad;
          continue;
        }
        for (uint8_t hit : c.result_bytes) bad += hit == 1 ? 0 : 1;
      }
    }
  }
  connector.close();
  std::printf("batches=%d bad_results=%d\n", kBatches, bad);
  return bad == 0 ? 0 : 3;
}
