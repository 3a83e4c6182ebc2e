#include "host_worker.h"

#include <pthread.h>

#include <new>
#include <set>

#include "errors.h"

namespace fastpipe {
namespace {

std::atomic<int> g_live_threads{0};

std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}
std::set<HostWorker*>& registry() {
  static std::set<HostWorker*> workers;
  return workers;
}

// fork(): keep the registry consistent, then mark every worker dead in the child.
void prepare_fork() { registry_mu().lock(); }
void parent_after_fork() { registry_mu().unlock(); }
void child_after_fork() {
  for (HostWorker* w : registry()) w->abandon_after_fork();
  g_live_threads.store(0);
  registry_mu().unlock();
}

void install_fork_handlers() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(prepare_fork, parent_after_fork, child_after_fork); });
}

}  // namespace

int live_host_threads() { return g_live_threads.load(); }

void HostEventState::mark() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    time_ = std::chrono::steady_clock::now();
    done_ = true;
  }
  cv_.notify_all();
}

void HostEventState::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_; });
}

bool HostEventState::query() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::chrono::steady_clock::time_point HostEventState::time() {
  std::lock_guard<std::mutex> lock(mu_);
  return time_;
}

HostWorker::HostWorker() {
  install_fork_handlers();
  g_live_threads.fetch_add(1);  // counted before start so close() never sees it negative
  try {
    thread_ = std::thread([this] { run(); });
  } catch (...) {
    g_live_threads.fetch_sub(1);
    throw;
  }
  std::lock_guard<std::mutex> lock(registry_mu());
  registry().insert(this);
}

HostWorker::~HostWorker() {
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    registry().erase(this);
  }
  close();
}

void HostWorker::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) break;  // stopping and drained
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::string failure;
    try {
      task();
    } catch (const std::exception& e) {
      failure = e.what();
    } catch (...) {
      failure = "unknown error in host stream task";
    }
    task = nullptr;  // drop captured state outside the lock
    lock.lock();
    if (!failure.empty() && error_.empty()) error_ = failure;
    ++completed_;
    done_cv_.notify_all();
  }
  lock.unlock();
  g_live_threads.fetch_sub(1);
}

void HostWorker::check_not_forked() const {
  if (forked_.load())
    throw Error("host stream was created before fork(); its worker thread does not exist in this process");
}

void HostWorker::abandon_after_fork() {
  forked_.store(true);
  // The worker thread does not exist in the child: never join it or touch its
  // (possibly locked) mutex. Moving the handle into a leaked object keeps
  // ~std::thread from calling std::terminate on a "joinable" thread.
  new std::thread(std::move(thread_));
  joined_ = true;
}

void HostWorker::enqueue(std::function<void()> task) {
  check_not_forked();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw Error("stream is closed");
    queue_.push_back(std::move(task));
    ++submitted_;
  }
  work_cv_.notify_one();
}

void HostWorker::synchronize() {
  check_not_forked();
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t target = submitted_;
  done_cv_.wait(lock, [this, target] { return completed_ >= target; });
  if (!error_.empty()) {
    std::string e;
    e.swap(error_);
    throw Error("error in host stream task: " + e);
  }
}

bool HostWorker::query() {
  check_not_forked();
  std::lock_guard<std::mutex> lock(mu_);
  return completed_ >= submitted_;
}

bool HostWorker::closed() {
  if (forked_.load()) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return stopping_;
}

void HostWorker::close() {
  if (forked_.load()) return;
  std::lock_guard<std::mutex> join_lock(join_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  if (!joined_) {
    if (thread_.joinable()) {
      if (thread_.get_id() == std::this_thread::get_id()) {
        thread_.detach();  // cannot happen from Python; be safe anyway
      } else {
        thread_.join();
      }
    }
    joined_ = true;
  }
}

void shutdown_host_workers() {
  std::lock_guard<std::mutex> lock(registry_mu());
  for (HostWorker* w : registry()) w->close();
}

}  // namespace fastpipe
