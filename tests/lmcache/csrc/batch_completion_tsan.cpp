// Drives ConnectorBase's batch completion path from several worker threads,
// built with -fsanitize=thread by test_0002_batch_completion_ordering.py.
//
// A batch GET is split into one tile per worker; each tile writes its keys'
// per-key results and decrements remaining_tiles, and the last tile hands
// per_key_results to the completion that this (main) thread drains. Tile 0 is
// slow, so it is usually the last one: the other tiles' result writes then
// reach the main thread only through the decrement. TSan reports a data race
// on those writes unless the decrement orders them (acq_rel).
#include "connector_base.h"

#include <poll.h>

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

class SlowFirstKeyConnector : public lc::ConnectorBase<int> {
 public:
  SlowFirstKeyConnector() : ConnectorBase(kWorkers) { start_workers(); }
  ~SlowFirstKeyConnector() override { close(); }

 protected:
  int create_connection() override { return 0; }
  void do_single_get(int&, const std::string& key, void* buf, size_t len,
                     size_t) override {
    if (key == "k0") {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::memset(buf, 0x5a, len);
  }
  void do_single_set(int&, const std::string&, const void*, size_t,
                     size_t) override {}
  bool do_single_exists(int&, const std::string&) override { return true; }
};

}  // namespace

int main() {
  SlowFirstKeyConnector connector;
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
