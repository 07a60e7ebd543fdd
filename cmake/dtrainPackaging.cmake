# `cpack -G DEB` in a build directory makes a Debian package of what `cmake --install` installs:
# libdtrain, its headers, dtrainConfig.cmake and the tools. Dependencies come from dpkg-shlibdeps
# (the shared libraries the binaries link) plus, for a static libdtrain, the -dev packages that
# dtrainConfig.cmake finds again.
set(CPACK_PACKAGE_NAME dtrain)
set(CPACK_PACKAGE_VENDOR "dtrain")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "C++20 distributed training shaped like tf.distribute")
set(CPACK_PACKAGE_CONTACT "dtrain developers <dtrain@localhost>")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEB_COMPONENT_INSTALL OFF)
set(_dtrain_deb_depends "libc6-dev, cmake (>= 3.25)")
if(NOT BUILD_SHARED_LIBS)
  string(APPEND _dtrain_deb_depends ", libdnnl-dev, ocl-icd-opencl-dev, opencl-headers, zlib1g-dev, libssl-dev")
  if(DTRAIN_HAVE_MPI)
    string(APPEND _dtrain_deb_depends ", libopenmpi-dev")
  endif()
endif()
set(CPACK_DEBIAN_PACKAGE_DEPENDS "${_dtrain_deb_depends}")
set(CPACK_GENERATOR DEB)
include(CPack)
