// A stream held for a given time: what a simulated PCIe link (engine/rig.py) costs between two stages
// of a split decode step. One thread reads the global nanosecond timer until `ns` have passed since it
// started, so the work queued after it on the stream starts that much later while the host thread and
// the other streams go on. No memory is touched.

extern "C" __global__ void link_hold(unsigned long long ns) {
    pdl_entry();
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
