// Inner loop of the HeterMoE step simulator (megatron_hetermoe/planner/simulator.py: run_python
// is the reference; this is the same algorithm, checked against it on random plans).
//
// Ranks walk their task lists in order. A compute task starts when the rank's previous compute
// task ended and the collective it waits for (ref >= 0) ended. A comm task is issued at the
// rank's current time and does not block; a collective starts when each of its coll_members[c]
// ranks has issued it and its stream is free (streams: any ids >= 0).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace py = pybind11;

using I64 = py::array_t<long long, py::array::c_style | py::array::forcecast>;
using F64 = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Result = std::tuple<F64, F64, F64, F64>;

// Arrays (numpy, or anything numpy converts): offsets[n+1] into the flat task arrays is_comm,
// dur, ref; coll_stream, coll_dur and coll_members per collective.
static Result run(I64 offsets_a, I64 is_comm_a, F64 dur_a, I64 ref_a, I64 coll_stream_a, F64 coll_dur_a,
                  I64 coll_members_a) {
    const long long* offsets = offsets_a.data();
    const long long* is_comm = is_comm_a.data();
    const double* dur = dur_a.data();
    const long long* ref = ref_a.data();
    const long long* coll_stream = coll_stream_a.data();
    const double* coll_dur = coll_dur_a.data();
    const long long* coll_members = coll_members_a.data();
    const size_t n = static_cast<size_t>(offsets_a.size()) - 1;
    const size_t nc = static_cast<size_t>(coll_dur_a.size());
    const size_t ntask = static_cast<size_t>(is_comm_a.size());
    if (static_cast<size_t>(dur_a.size()) != ntask || static_cast<size_t>(ref_a.size()) != ntask ||
        static_cast<size_t>(coll_stream_a.size()) != nc || static_cast<size_t>(coll_members_a.size()) != nc ||
        (n > 0 && static_cast<size_t>(offsets[n]) != ntask))
        throw std::invalid_argument("_csim.run: array lengths disagree (offsets, is_comm, dur, ref, coll_*)");
    long long nstream = 0;
    for (size_t c = 0; c < nc; ++c) {
        if (coll_stream[c] < 0) throw std::invalid_argument("_csim.run: a collective has a stream id < 0");
        nstream = std::max(nstream, coll_stream[c] + 1);
    }
    for (size_t i = 0; i < ntask; ++i)
        if (ref[i] >= static_cast<long long>(nc) || (is_comm[i] && ref[i] < 0))
            throw std::invalid_argument("_csim.run: a task refers to a collective id outside 0..len(coll_dur)-1");
    std::vector<long long> issued(nc, 0);
    std::vector<double> issue_max(nc, 0.0), cstart(nc, 0.0), cend(nc, -1.0);
    std::vector<double> stream_free(static_cast<size_t>(nstream), 0.0);
    std::vector<long long> pc(n);
    std::vector<double> host(n, 0.0);
    for (size_t r = 0; r < n; ++r) pc[r] = offsets[r];
    std::vector<double> start(ntask, 0.0), end(ntask, 0.0);
    size_t remaining = ntask;
    while (remaining) {
        bool progress = false;
        for (size_t r = 0; r < n; ++r) {
            long long i = pc[r];
            const long long stop = offsets[r + 1];
            double h = host[r];
            while (i < stop) {
                const long long c = ref[i];
                if (is_comm[i]) {
                    issued[c] += 1;
                    if (h > issue_max[c]) issue_max[c] = h;
                    if (issued[c] == coll_members[c]) {  // last member issued it
                        const long long s = coll_stream[c];
                        const double t0 = std::max(issue_max[c], stream_free[s]);
                        cstart[c] = t0;
                        cend[c] = t0 + coll_dur[c];
                        stream_free[s] = cend[c];
                    }
                } else {
                    if (c >= 0) {
                        if (cend[c] < 0) break;
                        if (cend[c] > h) h = cend[c];
                    }
                    start[i] = h;
                    h += dur[i];
                    end[i] = h;
                }
                ++i;
                --remaining;
                progress = true;
            }
            pc[r] = i;
            host[r] = h;
        }
        if (!progress) {
            std::ostringstream msg;
            msg << "task lists deadlock: representative ranks blocked at task index";
            for (size_t r = 0; r < n; ++r)
                if (pc[r] < offsets[r + 1]) msg << " " << r << ":" << (pc[r] - offsets[r]);
            msg << "; the lists do not issue collectives in one order";
            throw std::runtime_error(msg.str());
        }
    }
    for (size_t i = 0; i < ntask; ++i)
        if (is_comm[i]) {
            start[i] = cstart[ref[i]];
            end[i] = cend[ref[i]];
        }
    auto arr = [](const std::vector<double>& v) { return F64(static_cast<py::ssize_t>(v.size()), v.data()); };
    return Result(arr(start), arr(end), arr(cstart), arr(cend));
}

PYBIND11_MODULE(_csim, m) {
    m.doc() = "C++ core of the HeterMoE step simulator (see megatron_hetermoe/planner/simulator.py)";
    m.attr("ABI") = 2;  // run()'s arguments; simulator.have_cpp refuses a stale build
    m.def("run", &run, py::arg("offsets"), py::arg("is_comm"), py::arg("dur"), py::arg("ref"),
          py::arg("coll_stream"), py::arg("coll_dur"), py::arg("coll_members"),
          "Simulate flattened task lists; returns (task_start, task_end, coll_start, coll_end).");
}
