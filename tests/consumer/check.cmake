# Builds and runs tests/consumer against dtrain both ways a CMake user does (run by CTest):
#   cmake -DDTRAIN_BUILD_DIR=<dtrain build> -DDTRAIN_SOURCE_DIR=<checkout> -DWORK_DIR=<scratch>
#         -DMODE=install|subdirectory -P check.cmake
# install: `cmake --install` into a prefix, then find_package(dtrain) from there.
# subdirectory: add_subdirectory() of the source tree (a full build of libdtrain at -O0, CUDA and MPI
# off); dtrain must leave the parent's build type alone.
cmake_minimum_required(VERSION 3.25)
foreach(v DTRAIN_BUILD_DIR DTRAIN_SOURCE_DIR WORK_DIR MODE)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "check.cmake: -D${v}=... is required")
  endif()
endforeach()
set(consumer ${DTRAIN_SOURCE_DIR}/tests/consumer)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "failed (${rc}): ${cmd}")
  endif()
endfunction()

cmake_host_system_information(RESULT cores QUERY NUMBER_OF_LOGICAL_CORES)
if(MODE STREQUAL "install")
  run(${CMAKE_COMMAND} --install ${DTRAIN_BUILD_DIR} --prefix ${WORK_DIR}/prefix)
  set(expected include/dtrain/dtrain.h include/dtrain/core/export.h bin/dtrain-run bin/dtrain-ps
               lib/cmake/dtrain/dtrainConfig.cmake lib/cmake/dtrain/dtrainConfigVersion.cmake
               lib/cmake/dtrain/dtrainTargets.cmake)
  if(EXISTS ${DTRAIN_BUILD_DIR}/tools/dtrain-bench)  # built unless DTRAIN_BUILD_BENCH=OFF
    list(APPEND expected bin/dtrain-bench)
  endif()
  foreach(f ${expected})
    if(NOT EXISTS ${WORK_DIR}/prefix/${f})
      message(FATAL_ERROR "cmake --install did not install ${f}")
    endif()
  endforeach()
  run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/build -DCMAKE_BUILD_TYPE=Release
      -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
elseif(MODE STREQUAL "subdirectory")
  # Through ccache when dtrain's own build uses it (-DCCACHE=<program>): the second and later runs of
  # this test then compile nothing (the consumer's build inherits these variables).
  if(CCACHE)
    set(ENV{CMAKE_CXX_COMPILER_LAUNCHER} ${CCACHE})
    set(ENV{CCACHE_BASEDIR} ${DTRAIN_SOURCE_DIR})
  endif()
  # No build type: the parent project's choice (none: -O0) reaches dtrain, which compiles about a
  # third faster than Release; what is checked is the CMake wiring, not the speed.
  run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/build -DCMAKE_BUILD_TYPE=
      -DDTRAIN_SOURCE_DIR=${DTRAIN_SOURCE_DIR} -DDTRAIN_WITH_CUDA=OFF -DDTRAIN_WITH_MPI=OFF)
  file(STRINGS ${WORK_DIR}/build/CMakeCache.txt build_type REGEX "^CMAKE_BUILD_TYPE:")
  if(NOT build_type STREQUAL "CMAKE_BUILD_TYPE:STRING=")
    message(FATAL_ERROR "dtrain as a subproject changed the parent's build type: ${build_type}")
  endif()
else()
  message(FATAL_ERROR "MODE must be install or subdirectory, got '${MODE}'")
endif()
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build -j ${cores})
run(${WORK_DIR}/build/consumer)
message(STATUS "consumer project built and ran (${MODE})")
