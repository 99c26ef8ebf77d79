// libupipe_mpi: the MPI side of a multi-process NCCL start, in a plugin of its own so
// that the upipe binary never links MPI (it loads this only when a launcher started it,
// and a machine without MPI still runs everything else). MPI does three things here:
// say this process's rank and the job's size, carry NCCL's id from rank 0 to the
// others, and end the whole job when one rank fails.
#include <mpi.h>

#include <cstdlib>

extern "C" {

int upipe_mpi_init(int* rank, int* size) {
  int initialized = 0;
  if (MPI_Initialized(&initialized) != MPI_SUCCESS) return 1;
  if (!initialized) {
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) return 1;
    std::atexit([] {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Finalize();
    });
  }
  if (MPI_Comm_rank(MPI_COMM_WORLD, rank) != MPI_SUCCESS) return 1;
  return MPI_Comm_size(MPI_COMM_WORLD, size) == MPI_SUCCESS ? 0 : 1;
}

int upipe_mpi_broadcast(void* data, int bytes) {
  return MPI_Bcast(data, bytes, MPI_BYTE, 0, MPI_COMM_WORLD) == MPI_SUCCESS ? 0 : 1;
}

void upipe_mpi_abort(int code) { MPI_Abort(MPI_COMM_WORLD, code); }

}  // extern "C"
