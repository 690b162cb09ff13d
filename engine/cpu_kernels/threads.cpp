// Binds the OpenMP threads of the calling thread's team to cores, one core each.
//
// torch's CPU operators run on the OpenMP team of the thread that calls them (for a
// worker, its engine thread). Left to the kernel, the team's threads float over the
// worker's cores, and on a machine whose cores the router and clients share, the
// scheduler often wakes a sleeping helper on the core its master runs on: the two halves
// of every parallel region then run one after the other. On the 2-core development
// machine this made a served small-model decode step take 21.7 ms against 11-12.6 ms
// offline (docs/performance.md). vLLM's CPU build binds its OpenMP threads the same way.
//
// bind_threads(cores): a parallel region of len(cores) threads in which thread i binds
// itself to cores[i]; later regions of up to that many threads reuse the same threads.
// Returns the core each thread found itself on (-1 where binding failed).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "steal.h"

#if defined(__linux__)
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

// Thread ids (Linux tids) of the team the last bind_threads bound, thread 0 first.
std::vector<int64_t> g_team_tids;

std::vector<int64_t> bind_threads(const std::vector<int64_t>& cores) {
  const int n = static_cast<int>(cores.size());
  std::vector<int64_t> got(n, -1);
  TORCH_CHECK(n >= 1, "bind_threads: no cores given");
#if defined(__linux__) && defined(_OPENMP)
  std::vector<int64_t> tids(n, -1);
#pragma omp parallel num_threads(n)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cores[i]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) got[i] = sched_getcpu();
    tids[i] = static_cast<int64_t>(syscall(SYS_gettid));
  }
  g_team_tids = tids;
#endif
  return got;
}

std::vector<int64_t> team_tids() { return g_team_tids; }

// the decode steps' weight streams: shares a free thread takes over (steal.h), or fixed
// ones; returns the previous setting
bool set_work_stealing(bool on) { return tandem_steal::enabled().exchange(on); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("bind_threads(int[] cores) -> int[]", &bind_threads);
  m.def("team_tids() -> int[]", &team_tids);
  m.def("set_work_stealing(bool on) -> bool", &set_work_stealing);
}
